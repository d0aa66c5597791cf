"""The OpenAI-compatible HTTP API through the official `openai` client, and gRPC chat messages, on one real stack.

One coordinator, in front of the session's tiny Llama workers, serves both APIs: its tokenizer is the pair's,
saved with a chat template written into its tokenizer_config.json (the pair's own has none). Batches of one and a
queue of three (room for the samples of n=3) make a full queue cheap to provoke. The last test drains the
coordinator (503s), so it runs last.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from conftest import hf_processed_greedy
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client.parser import text_string_to_metric_families
from stack import (
    REPO,
    SERVICE_ENV,
    Service,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    assert_same_top,
    generate,
    running_coordinator,
    server_port,
)

from coordinator.http_answers import ApiError, token_entries
from coordinator.http_api import BodyLimit
from coordinator.tool_calls import ToolCallStream, ToolChoice, parse_tool_calls
from coordinator.validation import chat_prompt_ids
from minedraft.engine.models import load_tokenizer
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

K = 4
TEMPLATE = (  # (tools and calls as Hermes' and Qwen's templates write them)
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS: list[Any] = [  # (short: the tiny pair's context is 252 tokens of a 300-token vocabulary)
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "time"}},
]
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "def fib(n):"},
]
PROMPT = "def parse(argv):\n    "
NAMES = ("tiny-chat", "tiny-alias")  # --served-model-name
LONG = 230  # output tokens that take seconds: a request that must be cut short by its client going away


@dataclass
class Stack:
    coordinator: Service
    base_url: str
    metrics_port: int
    model: str
    tokenizer: Any  # the coordinator's, with the chat template
    client: openai.OpenAI

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return float(sample.value)
        return 0.0


def chat_tokenizer_dir(tiny_pairs: TinyPairs, root: Path) -> Path:
    """The pair's tokenizer saved with save_pretrained, a chat template written into its config."""
    directory = root / "chat-tokenizer"
    tiny_pairs.tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATE
    config_path.write_text(json.dumps(config))
    return directory


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture(scope="module")
def stack(
    llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    tokenizer_dir = chat_tokenizer_dir(tiny_pairs, tmp_path_factory.mktemp("http_api"))
    with contextlib.ExitStack() as stop:
        for attempt in range(3):  # ports picked here may be taken before the coordinator binds them
            http_port, metrics_port = server_port(), server_port()
            extra = ["--tokenizer", str(tokenizer_dir), "--speculation", "always", "--served-model-name", *NAMES]
            extra += ["--http-port", str(http_port), "--metrics-port", str(metrics_port)]
            try:
                coordinator = stop.enter_context(
                    running_coordinator(
                        llama_workers, stack_logs, "psd", k=K, max_batch_size=1, max_queue_size=3, extra=extra
                    )
                )
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        base_url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 30
        while True:  # the HTTP API starts just after the gRPC server reports SERVING
            with contextlib.suppress(OSError):
                if _get(f"{base_url}/health")[0] == 200:
                    break
            assert time.monotonic() < deadline, coordinator.log_tail()
            time.sleep(0.1)
        model = _get(f"{base_url}/v1/models")[1]["data"][0]["id"]
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield Stack(coordinator, base_url, metrics_port, model, load_tokenizer(str(tokenizer_dir)), client)


def _post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def _grpc(stack: Stack, **fields: Any) -> Any:
    params = generation_pb2.SamplingParams(max_tokens=12, ignore_eos=True)
    return asyncio.run(generate(stack.coordinator.address, generation_pb2.GenerateRequest(params=params, **fields)))


def _chat(stack: Stack, messages: list[Any], **kwargs: Any) -> Any:
    """A greedy chat completion of 12 tokens (EOS ignored) of `messages`."""
    request: dict[str, Any] = dict(
        model=stack.model, messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return stack.client.chat.completions.create(**request | kwargs)


def _grpc_messages(messages: list[dict[str, str]]) -> list[generation_pb2.ChatMessage]:
    return [generation_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]


# --------------------------------------------------------------------------------------------- answers


def test_models_and_health(stack: Stack, llama_workers: Workers) -> None:
    """--served-model-name: each name listed (the first is the model's id), each taken, the answer naming it."""
    models = stack.client.models.list().data
    assert [m.id for m in models] == list(NAMES) == [stack.model, "tiny-alias"] and models[0].object == "model"
    assert models[0].model_extra["root"] == str(llama_workers.pair.target)  # type: ignore[index]
    assert _get(f"{stack.base_url}/health") == (200, {"status": "serving"})
    done = stack.client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=2)
    assert done.model == "tiny-alias"
    with pytest.raises(openai.NotFoundError):
        stack.client.completions.create(model=str(llama_workers.pair.target), prompt=PROMPT, max_tokens=2)


def test_greedy_completion_equals_grpc_and_the_target_alone(
    stack: Stack, llama_workers: Workers, hf_reference: Any
) -> None:
    from transformers import AutoModelForCausalLM

    ids = stack.tokenizer.encode(PROMPT)
    over_grpc = _grpc(stack, prompt_token_ids=ids)
    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")
    assert over_grpc.token_ids == hf_reference(target, ids, 12)  # lossless
    for prompt in (PROMPT, ids):
        done = stack.client.completions.create(
            model=stack.model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        (choice,) = done.choices
        assert choice.text == over_grpc.text and choice.finish_reason == "length"
        assert done.object == "text_completion" and done.id.startswith("cmpl-") and done.model == stack.model
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 12)
        assert done.usage.total_tokens == len(ids) + 12


def test_metrics_on_the_http_port_with_vllm_names(stack: Stack) -> None:
    """/metrics on the HTTP port is the --metrics-port registry, with vLLM's names (model_name labels) beside."""
    stack.client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}

    def value(name: str, sample: str = "", **labels: str) -> float:
        return sum(
            s.value
            for s in families[name].samples
            if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items())
        )

    vllm = {name for name in families if name.startswith("vllm:")}
    assert vllm >= {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_success",
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    }, vllm
    assert all(s.labels["model_name"] == stack.model for name in vllm for s in families[name].samples)
    for ours, theirs in [
        ("minedraft_generation_tokens", "vllm:generation_tokens"),
        ("minedraft_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
        ("minedraft_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
        ("minedraft_verified_sequences", "vllm:spec_decode_num_drafts"),
    ]:
        assert value(ours, ours + "_total") == value(theirs, theirs + "_total"), ours
    assert value("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens_total") > 0
    ttft = "vllm:time_to_first_token_seconds"
    assert (
        value(ttft, ttft + "_count")
        == value("minedraft_time_to_first_token_seconds", ttft.replace("vllm:", "minedraft_") + "_count")
        > 0
    )
    assert value("vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 1
    assert 0 <= value("vllm:kv_cache_usage_perc") <= 1
    # (the same label set on both ports: the counter has one per finish reason, and earlier tests may end some
    # requests otherwise than by length)
    ended = value("minedraft_requests", "minedraft_requests_total", finish_reason="length")
    assert ended == stack.metric("minedraft_requests_total", finish_reason="length") >= 1


def test_tokenize_detokenize_and_version(stack: Stack) -> None:
    status, tokens = _post(f"{stack.base_url}/tokenize", {"model": stack.model, "prompt": PROMPT})
    assert (
        status == 200
        and tokens["tokens"] == stack.tokenizer.encode(PROMPT)
        and tokens["count"] == len(tokens["tokens"])
    )
    assert tokens["max_model_len"] > 0
    status, chat = _post(f"{stack.base_url}/tokenize", {"messages": MESSAGES})
    assert chat["tokens"] == stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert _post(f"{stack.base_url}/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": PROMPT})
    status, error = _post(f"{stack.base_url}/detokenize", {"tokens": [10**6]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, version = _get(f"{stack.base_url}/version")
    assert status == 200 and version["version"]


def test_usage_reports_the_speculation(stack: Stack) -> None:
    done = stack.client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None
    spec = done.usage.model_extra["speculation"]  # type: ignore[index]
    assert spec["drafted_steps"] >= 1 and spec["draft_tokens"] == K * spec["drafted_steps"]  # --speculation always
    assert 0 <= spec["accepted_tokens"] <= done.usage.completion_tokens
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafted_steps"], 1e-4)
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    assert set(spec) >= {"acceptance_rate", "steps"}


def test_usage_reports_the_prompt_tokens_found_in_the_prefix_cache(stack: Stack) -> None:
    prompt = [7 + i % 50 for i in range(40)]  # token ids: 2 full blocks of 16 before the last token
    calls = [stack.client.completions.create(model=stack.model, prompt=prompt, max_tokens=2) for _ in range(2)]
    cached = [c.usage.prompt_tokens_details.cached_tokens for c in calls]  # type: ignore[union-attr]
    assert cached[1] == 32 and cached[0] in (0, 32), cached


def test_streamed_completion_with_usage(stack: Stack) -> None:
    kwargs: dict[str, Any] = dict(model=stack.model, prompt=PROMPT, max_tokens=12, temperature=0)
    whole = stack.client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    chunks = list(
        stack.client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 12
    assert all(c.usage is None for c in text_chunks) and len({c.id for c in chunks}) == 1


def test_stop_string(stack: Stack) -> None:
    kwargs: dict[str, Any] = dict(model=stack.model, prompt=PROMPT, max_tokens=24, temperature=0)
    full = stack.client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    # A random model's text: its first printable ASCII character past the start (not a replacement character).
    stop = next((c for c in full[3:] if c.isascii() and c.isprintable()), None)
    assert stop is not None, full
    for stops in (stop, [stop, "never in it \u2603"]):
        done = stack.client.completions.create(**kwargs, stop=stops, extra_body={"ignore_eos": True})
        assert done.choices[0].text == full[: full.index(stop)] and done.choices[0].finish_reason == "stop"


def test_chat_completion_applies_the_template(stack: Stack) -> None:
    templated = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    by_ids = _grpc(stack, prompt_token_ids=templated)
    by_messages = _grpc(stack, messages=_grpc_messages(MESSAGES))
    assert by_messages.token_ids == by_ids.token_ids and by_messages.usage.prompt_tokens == len(templated)
    done = _chat(stack, MESSAGES)
    (choice,) = done.choices
    assert choice.message.role == "assistant" and choice.message.content == by_ids.text
    assert choice.finish_reason == "length" and done.object == "chat.completion"
    assert done.usage is not None and done.usage.prompt_tokens == len(templated)
    # Text parts are one text, as a string content is.
    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "def fib(n):"}]}]
    again = _chat(stack, parts)
    assert again.choices[0].message.content == by_ids.text


def test_streamed_chat_completion(stack: Stack) -> None:
    whole = _chat(stack, MESSAGES)
    chunks = list(_chat(stack, MESSAGES, stream=True, stream_options={"include_usage": True}))
    first, *deltas, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole.choices[0].message.content
    assert all(c.choices[0].finish_reason is None for c in [first, *deltas])
    assert finish.choices[0].finish_reason == "length" and not finish.choices[0].delta.content
    assert usage.choices == [] and usage.usage is not None and usage.usage.completion_tokens == 12
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def _grpc_logprobs(stack: Stack, prompt_ids: list[int], top: int) -> tuple[list[int], list[Any]]:
    """The greedy tokens of 12 (EOS ignored) over gRPC and their logprobs."""
    params = generation_pb2.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=top)
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt_ids, params=params)

    async def run() -> tuple[list[int], list[Any]]:
        tokens, logprobs = [], []
        async with grpc.aio.insecure_channel(stack.coordinator.address) as channel:
            async for message in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60):
                tokens += message.token_ids
                logprobs += message.logprobs
        return tokens, logprobs

    return asyncio.run(run())


def test_completion_logprobs_whole_and_streamed(stack: Stack, llama_workers: Workers) -> None:
    """`logprobs: 5` on a completion: OpenAI's legacy shape, what gRPC reports, and the target's own log_softmax."""
    from transformers import AutoModelForCausalLM

    ids = stack.tokenizer.encode(PROMPT)
    tokens, over_grpc = _grpc_logprobs(stack, ids, 5)
    kwargs: dict[str, Any] = dict(
        model=stack.model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=5, extra_body={"ignore_eos": True}
    )
    logprobs = stack.client.completions.create(**kwargs).choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert logprobs.tokens == [stack.tokenizer.decode([t]) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in over_grpc], abs=1e-5)
    for top, reported in zip(logprobs.top_logprobs, over_grpc):
        want = {stack.tokenizer.decode([t.token_id]): t.logprob for t in reported.top}
        assert_same_top(sorted(top.items(), key=lambda kv: -kv[1]), sorted(want.items(), key=lambda kv: -kv[1]))
        assert 1 <= len(top) <= 5 and len(reported.top) == 5
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(tokens))]
    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")
    with torch.inference_mode():
        logits = target(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-5)  # the target's own, drafted ones included
    streamed = [c.choices[0].logprobs for c in stack.client.completions.create(**kwargs, stream=True)]
    parts = [lp for lp in streamed if lp is not None]
    assert [t for lp in parts for t in lp.tokens or ()] == logprobs.tokens
    # (Another run: its steps may have drafted other positions, which float32 sums differently, well within 1e-5.)
    assert [v for lp in parts for v in lp.token_logprobs or ()] == pytest.approx(logprobs.token_logprobs, abs=1e-5)
    assert [o for lp in parts for o in lp.text_offset or ()] == logprobs.text_offset


def test_echo_with_prompt_logprobs_as_lm_eval_asks(stack: Stack, llama_workers: Workers) -> None:
    """`echo=true, max_tokens=0, logprobs=N` (lm-eval's loglikelihood): the prompt's own text, its tokens'
    log-probabilities the target's log_softmax at each position before (the first null), even for a prompt whose
    blocks the prefix cache holds; with max_tokens the completion follows the echoed prompt."""
    from transformers import AutoModelForCausalLM

    ids = [7 + i % 50 for i in range(40)]  # (a prompt another test had cached: its 2 full blocks)
    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")
    with torch.inference_mode():
        expected = target(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    want = expected.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    kwargs: dict[str, Any] = dict(model=stack.model, echo=True, logprobs=2, temperature=0)
    for _ in range(2):  # (the second finds the prompt cached: it is computed whole all the same)
        done = stack.client.completions.create(prompt=ids, max_tokens=0, **kwargs)
        (choice,) = done.choices
        assert choice.text == stack.tokenizer.decode(ids) and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
        assert logprobs.tokens == [stack.tokenizer.decode([t]) for t in ids]
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
        assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
        assert done.usage is not None and (done.usage.prompt_tokens, done.usage.completion_tokens) == (40, 0)
    plain = stack.client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    echoed = stack.client.completions.create(prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True}, **kwargs)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert len(echoed.choices[0].logprobs.token_logprobs or ()) == len(stack.tokenizer.encode(PROMPT)) + 4  # type: ignore[union-attr]
    chunks = list(stack.client.completions.create(prompt=ids, max_tokens=0, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == stack.tokenizer.decode(ids)
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs or ()]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want, abs=1e-4)


def test_vllm_prompt_logprobs_equal_hf(stack: Stack, llama_workers: Workers) -> None:
    """vLLM's `prompt_logprobs` field: each prompt token's log-probability (the first None) with its rank and text,
    and the top ones, equal to HF's log_softmax; a completion's in its choice, beside an echo's fewer top ones; a
    chat's beside its choices; refused when streamed, as vLLM refuses it."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")

    def hf(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return target(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)

    def check(got: list[Any], ids: list[int], top: int) -> None:
        expected = hf(ids)
        assert len(got) == len(ids) and got[0] is None
        for position, (token, entries) in enumerate(zip(ids[1:], got[1:], strict=True)):
            best = expected[position].topk(top)
            want = {token: float(expected[position, token])} | dict(zip(best.indices.tolist(), best.values.tolist()))
            assert {int(t): e["logprob"] for t, e in entries.items()} == pytest.approx(want, abs=1e-4)
            assert entries[str(token)]["decoded_token"] == stack.tokenizer.decode([token])
            ranks = {int(t): e["rank"] for t, e in entries.items()}
            assert [ranks[t] for t in best.indices.tolist()] == list(range(1, top + 1))

    ids = [60 + i * 7 % 150 for i in range(24)]  # (a prompt of its own: the prefix cache keeps what tests send)
    done = stack.client.completions.create(
        model=stack.model,
        prompt=ids,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 3},
    )
    choice = done.choices[0].model_extra or {}
    check(choice["prompt_logprobs"], ids, 3)
    echoed = done.choices[0].logprobs
    assert echoed is not None and echoed.top_logprobs is not None and all(len(t) <= 1 for t in echoed.top_logprobs[1:])
    chat = _chat(stack, MESSAGES, extra_body={"ignore_eos": True, "prompt_logprobs": 0})
    templated = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    check((chat.model_extra or {})["prompt_logprobs"], templated, 0)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        stack.client.completions.create(model=stack.model, prompt=ids, stream=True, extra_body={"prompt_logprobs": 1})


def test_chat_logprobs_whole_and_streamed(stack: Stack) -> None:
    """`logprobs: true` and `top_logprobs` on a chat completion: OpenAI's content list, what gRPC reports."""
    templated = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    tokens, over_grpc = _grpc_logprobs(stack, templated, 3)
    done = _chat(stack, MESSAGES, logprobs=True, top_logprobs=3).choices[0]
    assert done.logprobs is not None and done.logprobs.content is not None
    content = done.logprobs.content
    # Special tokens (an end of turn) the text leaves out are left out of the logprobs too.
    kept = [(t, lp) for t, lp in zip(tokens, over_grpc) if t not in stack.tokenizer.all_special_ids]
    assert [c.token for c in content] == [stack.tokenizer.decode([t]) for t, _ in kept]
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for _, lp in kept], abs=1e-5)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    for c, (_, reported) in zip(content, kept):
        want = [(stack.tokenizer.decode([t.token_id]), t.logprob) for t in reported.top]
        assert_same_top([(t.token, t.logprob) for t in c.top_logprobs], want)
    chunks = list(_chat(stack, MESSAGES, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs is not None for e in c.choices[0].logprobs.content or ()]
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = _chat(stack, MESSAGES, logprobs=True).choices[0].logprobs
    assert plain is not None and plain.content is not None
    assert len(plain.content) == len(kept) and all(c.top_logprobs == [] for c in plain.content)
    assert _chat(stack, MESSAGES).choices[0].logprobs is None


def _template_ids(stack: Stack, messages: list[Any], tools: list[Any] | None = None) -> list[int]:
    return stack.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)["input_ids"]


def test_tools_in_each_tool_choice_through_the_template(stack: Stack) -> None:
    """tools and tool_choice through the official client: the template shows the tools (none: not at all, named:
    that one); required and named open the call in the assistant's turn and constrain it to the call's schema, so
    it parses and validates, answered as tool_calls, streamed too."""
    plain = _chat(stack, MESSAGES)
    none = _chat(stack, MESSAGES, tools=TOOLS, tool_choice="none")
    assert (
        none.choices[0].message.content == plain.choices[0].message.content and not none.choices[0].message.tool_calls
    )
    auto = _chat(stack, MESSAGES, tools=TOOLS)  # (a random model writes no call)
    assert auto.usage is not None and auto.usage.prompt_tokens == len(_template_ids(stack, MESSAGES, TOOLS))
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # type: ignore[union-attr]
    # Required and named: the call's JSON is constrained (its schema, compact JSON), so it is whole and valid, and
    # the grammar's end ends the answer.
    named_choice: Any = {"type": "function", "function": {"name": "time"}}
    forced = {"max_tokens": 56, "extra_body": {}, "tools": TOOLS}
    named = _chat(stack, MESSAGES, tool_choice=named_choice, **forced)
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "time" and call.type == "function" and call.id.startswith("call_")
    assert named.choices[0].message.content is None and named.choices[0].finish_reason == "tool_calls"
    assert json.loads(call.function.arguments) == {}  # (time takes no parameters)
    shown = TOOLS[1:]
    ids = _template_ids(stack, MESSAGES, shown) + stack.tokenizer.encode("<tool_call>\n", add_special_tokens=False)
    assert named.usage is not None and named.usage.prompt_tokens == len(ids)
    schema = ToolChoice("named", "time").call_schema(shown)
    output = generation_pb2.StructuredOutput(json_schema=schema, disable_any_whitespace=True)
    params = generation_pb2.SamplingParams(max_tokens=56, temperature=0, structured_output=output)
    over_grpc = asyncio.run(
        generate(stack.coordinator.address, generation_pb2.GenerateRequest(prompt_token_ids=ids, params=params))
    )
    assert json.loads(over_grpc.text) == {"name": "time", "arguments": {}}
    chunks = list(_chat(stack, MESSAGES, tool_choice=named_choice, stream=True, **forced))
    streamed = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or ()]
    assert [(c.index, c.function.name, c.function.arguments) for c in streamed] == [  # type: ignore[union-attr]
        (0, "time", call.function.arguments)
    ]
    assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # (tools without parameters: a random model's object of any properties may run past the context)
    either: Any = {"tools": [TOOLS[1], {"type": "function", "function": {"name": "date"}}]}
    for stream in (False, True):
        required = _chat(stack, MESSAGES, tool_choice="required", stream=stream, **forced | either)
        if stream:
            parts = [c for chunk in required for c in chunk.choices[0].delta.tool_calls or ()]
            calls = [(c.function.name, c.function.arguments) for c in parts]  # type: ignore[union-attr]
        else:
            calls = [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls or ()]
        ((name, arguments),) = calls
        assert name in ("time", "date") and json.loads(arguments) == {}
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        _chat(stack, MESSAGES, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    # A call and its result go back through the template as the model wrote and read them.
    history: list[Any] = [
        MESSAGES[1],
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    call_json = call.model_dump()
    with contextlib.suppress(ValueError):
        call_json["function"]["arguments"] = json.loads(call.function.arguments)
    rendered = [MESSAGES[1], {"role": "assistant", "content": "", "tool_calls": [call_json]}, history[-1]]
    again = _chat(stack, history)
    assert again.usage is not None and again.usage.prompt_tokens == len(_template_ids(stack, rendered))


def test_tool_call_parsing_whole_and_streamed() -> None:
    """The Hermes/Qwen format: text before a call is the content; each call its name and arguments (a JSON text);
    streamed, no part of a call's tag reaches the content."""
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    text += '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text, ToolChoice("auto"))
    assert content == "Let me look." and [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "time", "arguments": "{}"},
    ]
    assert len(parse_tool_calls(text, ToolChoice("auto", parallel=False))[1]) == 1
    assert parse_tool_calls("no call <tool_call>{not json", ToolChoice("auto")) == ("no call <tool_call>{not json", [])
    call = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    forced = parse_tool_calls(call, ToolChoice("named", "get_weather"))
    assert forced[0] is None and forced[1][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    unfinished = parse_tool_calls(call[:-8], ToolChoice("required"))  # (max_tokens cut the call short)
    assert unfinished[1][0]["function"] == {"name": "get_weather", "arguments": '{"city":'}
    for cut in (1, 5, 13, 14, 30):
        stream = ToolCallStream(ToolChoice("auto"))
        sent = stream.feed(text[:cut]) + stream.feed(text[cut:])
        rest, streamed = stream.finish()
        assert (sent + rest).strip() == "Let me look." and [c["function"] for c in streamed] == [
            c["function"] for c in calls
        ]
    plain = ToolCallStream(ToolChoice("auto"))
    assert plain.feed("a <tool") == "a " and plain.feed(" b") == "<tool b" and plain.finish() == ("", [])
    # Llama 3's format (--tool-call-parser llama3_json): the answer is the calls, as JSON joined by ";"
    llama = ToolChoice("auto", parser="llama3_json")
    text = '{"name": "weather", "parameters": {"city": "Oslo"}}; {"name": "time", "parameters": {}}'
    content, calls = parse_tool_calls(text, llama)
    assert content is None and [c["function"] for c in calls] == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'},
        {"name": "time", "arguments": "{}"},
    ]
    assert parse_tool_calls('It is {"name": "x"}', llama) == ('It is {"name": "x"}', [])
    stream = ToolCallStream(llama)
    assert stream.feed(text[:9]) == "" and stream.feed(text[9:]) == "" and len(stream.finish()[1]) == 2
    named = ToolChoice("named", "weather", parser="llama3_json")
    assert named.forced_prefix == "" and '"parameters"' in named.call_schema(TOOLS)
    called = parse_tool_calls('{"name": "weather", "parameters": {"city": "Oslo"}}', named)
    assert called[1][0]["function"]["arguments"] == '{"city": "Oslo"}'


def test_chat_logprobs_leave_out_the_special_tokens_the_text_leaves_out(tiny_pairs: TinyPairs) -> None:
    """An end of turn (here the tokenizer's EOS) decodes to nothing in a chat's text: its logprobs list it not; a
    completion's list every token, as OpenAI's and vLLM's do."""
    tokenizer: Any = tiny_pairs.tokenizer
    eos = tokenizer.eos_token_id
    message = generation_pb2.GenerateResponse(
        token_ids=[7, eos],
        logprobs=[generation_pb2.TokenLogprob(logprob=-1.0), generation_pb2.TokenLogprob(logprob=-0.5)],
    )
    request = generation_pb2.GenerateRequest(params=generation_pb2.SamplingParams(logprobs=0))
    chat, completion = (token_entries(request, tokenizer, chat)(message) for chat in (True, False))  # type: ignore[misc]
    assert chat == [(tokenizer.decode([7]), -1.0, [])]
    assert [token for token, _, _ in completion] == [tokenizer.decode([7]), tokenizer.decode([eos])]


def test_penalties_round_trip(stack: Stack, llama_workers: Workers) -> None:
    """Penalties and min_tokens through the openai client: greedy output equals HF `generate()` with the same
    logits processors; a chat completion's too."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")
    ids = stack.tokenizer.encode(PROMPT)
    penalties: dict[str, Any] = dict(presence_penalty=0.5, frequency_penalty=1.0)
    extra: dict[str, Any] = dict(repetition_penalty=1.5, min_tokens=6, min_p=0.05)
    config = SamplingConfig(max_tokens=16, **penalties, **extra)
    expected = hf_processed_greedy(target, ids, config, [0])
    assert expected != hf_processed_greedy(target, ids, SamplingConfig(max_tokens=16), [0])
    done = stack.client.completions.create(
        model=stack.model, prompt=ids, max_tokens=16, temperature=0, **penalties, extra_body=extra
    )
    assert done.choices[0].text == stack.tokenizer.decode(expected, skip_special_tokens=True)
    assert done.usage is not None and done.usage.completion_tokens == len(expected)
    templated = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    chat = _chat(stack, MESSAGES, max_tokens=16, frequency_penalty=1.5, extra_body={"ignore_eos": True})
    want = hf_processed_greedy(target, templated, SamplingConfig(max_tokens=16, frequency_penalty=1.5), [])
    assert chat.choices[0].message.content == stack.tokenizer.decode(want, skip_special_tokens=True)


def test_logit_bias_moves_the_greedy_answer_losslessly(stack: Stack, llama_workers: Workers) -> None:
    """logit_bias on draft and target alike (psd, every step drafted): greedy output equals HF `generate()` with the
    same bias, and differs from the unbiased one."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")
    ids = stack.tokenizer.encode(PROMPT)
    unbiased = hf_processed_greedy(target, ids, SamplingConfig(max_tokens=12), [])
    bias = {unbiased[0]: -100, unbiased[3]: -5, 7: 4}  # (the openai client's type: whole numbers)
    expected = hf_processed_greedy(target, ids, SamplingConfig(max_tokens=12, logit_bias=tuple(bias.items())), [])
    assert expected != unbiased
    done = stack.client.completions.create(
        model=stack.model,
        prompt=ids,
        max_tokens=12,
        temperature=0,
        logit_bias={str(k): v for k, v in bias.items()},
        extra_body={"ignore_eos": True},
    )
    assert done.choices[0].text == stack.tokenizer.decode(expected, skip_special_tokens=True)
    spec = done.usage.model_extra["speculation"]  # type: ignore[union-attr,index]
    assert spec["drafted_steps"] >= 1  # the draft proposed under the bias too


def test_the_stream_ends_with_done_on_the_wire(stack: Stack) -> None:
    """Server-sent events as OpenAI sends them: `data: {json}` events, the last `data: [DONE]`."""
    body = {"model": stack.model, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", int(stack.base_url.rsplit(":", 1)[1]), timeout=30)
    connection.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and reply.getheader("content-type", "").startswith("text/event-stream")
    events = [e for e in reply.read().decode().split("\n\n") if e]
    connection.close()
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["object"] == "text_completion"


# --------------------------------------------------------------------------------------------- structured outputs

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
CHOICES = ["return None", "pass", "raise"]


def test_structured_outputs_parse_and_equal_hf_with_the_same_matcher(stack: Stack, llama_workers: Workers) -> None:
    """A JSON schema (response_format, strict), a regex (guided_regex) and a choice (structured_outputs): greedy
    output parses or matches, ends with "stop" where the grammar does, and equals HF `generate()` with the same
    grammar as a logits processor, token for token (the count and the text)."""
    import jsonschema
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype="float32")
    templated = stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    ids = stack.tokenizer.encode(PROMPT)

    def expected(prompt: list[int], spec: tuple[str, str, bool]) -> list[int]:
        config = SamplingConfig(max_tokens=48, grammar=spec)
        return hf_processed_greedy(target, prompt, config, [0], stack.tokenizer)

    def check(done: Any, text: str, want: list[int]) -> None:
        assert text == stack.tokenizer.decode(want, skip_special_tokens=True)
        assert done.usage.completion_tokens == len(want) and done.choices[0].finish_reason == "stop"

    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    # (compact JSON: a random model's whitespace, where any is allowed, may never end)
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    chat = _chat(stack, MESSAGES, max_tokens=48, response_format=fmt, extra_body=compact)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    check(chat, chat.choices[0].message.content, expected(templated, ("json_schema", json.dumps(SCHEMA), True)))
    regex = r"(self|cls)\.[a-z_]{1,12} = (None|0|\[\])"
    done = stack.client.completions.create(
        model=stack.model, prompt=ids, max_tokens=48, temperature=0, extra_body={"guided_regex": regex}
    )
    assert re.fullmatch(regex, done.choices[0].text), done.choices[0].text
    check(done, done.choices[0].text, expected(ids, ("regex", regex, False)))
    choice = {"structured_outputs": {"choice": CHOICES}}
    done = stack.client.completions.create(
        model=stack.model, prompt=ids, max_tokens=48, temperature=0, extra_body=choice
    )
    assert done.choices[0].text in CHOICES
    check(done, done.choices[0].text, expected(ids, ("choice", json.dumps(CHOICES), False)))


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format",
            ("invalid json_schema", "Type should be a string"),
        ),
        ({"guided_regex": "a(b"}, "guided_regex", ("invalid regex", "parenthesis")),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar", ("invalid grammar", "foo")),
        ({"guided_choice": []}, "guided_choice", ("non-empty",)),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", ("give one",)),
        ({"response_format": {"type": "xml"}}, "response_format", ("one of text",)),
    ],
    ids=["schema", "regex", "grammar", "choice", "two", "format"],
)
def test_bad_structured_output_is_400_naming_the_field(
    stack: Stack, extra: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        stack.client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=4, extra_body=extra)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and error["code"] == "invalid_argument", error
    assert all(w in error["message"] for w in words), error


def test_structured_output_over_grpc(stack: Stack) -> None:
    """The same constraint on the gRPC API: a choice is honoured, a bad regex is INVALID_ARGUMENT with the engine's
    message."""
    output = generation_pb2.StructuredOutput(choice=generation_pb2.StructuredChoice(choices=CHOICES))
    params = generation_pb2.SamplingParams(max_tokens=12, structured_output=output)
    done = asyncio.run(
        generate(stack.coordinator.address, generation_pb2.GenerateRequest(prompt=PROMPT, params=params))
    )
    assert done.text in CHOICES and done.finish_reason == generation_pb2.FINISH_REASON_STOP
    params.structured_output.regex = "a(b"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(generate(stack.coordinator.address, generation_pb2.GenerateRequest(prompt=PROMPT, params=params)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid regex" in str(info.value.details()) and "parenthesis" in str(info.value.details())


def test_n_completions_whole_and_streamed(stack: Stack) -> None:
    kwargs: dict[str, Any] = dict(
        model=stack.model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3, extra_body={"ignore_eos": True}
    )
    whole = stack.client.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in whole.choices)
    assert len({c.text for c in whole.choices}) == 3  # seeded with seed + index: three different samples
    assert whole.usage is not None and whole.usage.prompt_tokens == len(stack.tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == 3 * 8  # the prompt counted once, the choices' tokens summed
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    chunks = list(stack.client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    *text_chunks, last = chunks
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in text_chunks:
        (choice,) = chunk.choices
        assert reasons[choice.index] is None  # nothing after a choice's finish reason
        texts[choice.index] += choice.text
        reasons[choice.index] = choice.finish_reason  # type: ignore[call-overload]
    assert texts == [c.text for c in whole.choices] and reasons == ["length"] * 3  # the seeds reproduce them
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 24


def test_n_chat_completions_whole_and_streamed(stack: Stack) -> None:
    one = _chat(stack, MESSAGES).choices[0].message.content
    two = _chat(stack, MESSAGES, n=2)
    assert [(c.index, c.message.content, c.finish_reason) for c in two.choices] == [
        (0, one, "length"),
        (1, one, "length"),
    ]
    assert two.usage is not None and two.usage.completion_tokens == 24
    contents, roles = ["", ""], [0, 0]
    for chunk in _chat(stack, MESSAGES, n=2, stream=True):
        (choice,) = chunk.choices
        roles[choice.index] += choice.delta.role == "assistant"
        contents[choice.index] += choice.delta.content or ""
    assert contents == [one, one] and roles == [1, 1]  # one opening chunk per choice


def test_n_samples_prefilled_later_find_the_prompt_cached(stack: Stack) -> None:
    """Two batches of one: samples 0 and 1 are prefilled together (each computes the prompt), sample 2 once a row is
    free, finding the prompt's 2 full blocks in the target's prefix cache."""
    from minedraft.proto import generation_pb2_grpc

    prompt = [9 + i % 47 for i in range(40)]  # not a prompt another test sends

    async def three() -> dict[int, generation_pb2.Usage]:
        params = generation_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
        usages = {}
        async with grpc.aio.insecure_channel(stack.coordinator.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            async for message in stub.Generate(
                generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params, n=3)
            ):
                if message.finish_reason:
                    usages[message.index] = message.usage
        return usages

    usages = asyncio.run(three())
    cached = [usages[i].cached_prompt_tokens for i in range(3)]
    assert cached[2] == 32 and cached[0] == 0, cached


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"n": 17}, "n", ("at most 16",)),
        ({"n": 0}, "n", ("greater than or equal",)),
        ({"logprobs": 21}, "logprobs", ("at most 20",)),
        ({"presence_penalty": 2.5}, "presence_penalty", ("[-2, 2]",)),
        ({"frequency_penalty": -3}, "frequency_penalty", ("[-2, 2]",)),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", ("> 0",)),
        ({"extra_body": {"min_p": 1.5}}, "min_p", ("[0, 1]",)),
        ({"extra_body": {"min_tokens": 5}}, "min_tokens", ("max_tokens (4)",)),
        ({"logit_bias": {"x": 1.0}}, "logit_bias", ("token ids",)),
        ({"logit_bias": {"5": 101.0}}, "logit_bias", ("[-100, 100]",)),
        ({"logit_bias": {str(10**6): 1.0}}, "logit_bias", ("vocabulary",)),
        ({"temperature": -1}, "temperature", ("temperature", ">= 0")),
        ({"top_p": 0}, "top_p", ("top_p", "(0, 1]")),
        ({"max_tokens": 0}, "max_tokens", ("max_tokens", ">= 1")),
        ({"max_tokens": 400}, "max_tokens", ("context",)),
        ({"prompt": ""}, "prompt", ("empty",)),
        ({"prompt": [1, 2, 10**6]}, "prompt", ("vocabulary",)),
        ({"seed": -1}, "seed", ("greater than or equal",)),
        ({"prompt": "a" * ((1 << 20) + 1)}, "prompt", ("--max-prompt-bytes", str(1 << 20))),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", ("--max-stop-strings", "16")),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(v),
)
def test_bad_completion_is_400_naming_the_field(
    stack: Stack, kwargs: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    request = {"model": stack.model, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        stack.client.completions.create(**request)
    error = info.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert all(w in error["message"] for w in words), error


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages.0.content"),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_tokens"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(v),
)
def test_bad_chat_completion_is_400_naming_the_field(stack: Stack, kwargs: dict[str, Any], param: str) -> None:
    request = {"model": stack.model, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        stack.client.chat.completions.create(**request)
    assert isinstance(info.value.body, dict) and info.value.body["param"].startswith(param), info.value.body


def test_several_prompts_in_one_completion_request(stack: Stack) -> None:
    """A list of prompts (texts or token ids): OpenAI's choices, prompt by prompt, each prompt's n in turn."""
    ids = stack.tokenizer.encode("import os\n")
    kwargs: dict[str, Any] = dict(model=stack.model, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    alone = [stack.client.completions.create(prompt=p, **kwargs).choices[0].text for p in (PROMPT, "x = 1")]
    # (Two prompts of n=1: a queue of three holds their samples whenever they come.)
    both = stack.client.completions.create(prompt=[PROMPT, "x = 1"], **kwargs)
    assert [(c.index, c.text) for c in both.choices] == [(0, alone[0]), (1, alone[1])]
    assert both.usage is not None and both.usage.completion_tokens == 10
    assert both.usage.prompt_tokens == len(stack.tokenizer.encode(PROMPT)) + len(stack.tokenizer.encode("x = 1"))
    by_ids = stack.client.completions.create(prompt=[ids], n=2, **kwargs)
    assert [c.index for c in by_ids.choices] == [0, 1] and by_ids.choices[0].text == by_ids.choices[1].text
    texts = ["", ""]
    for chunk in stack.client.completions.create(prompt=[PROMPT, "x = 1"], stream=True, **kwargs):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
    assert texts == alone


def test_unknown_fields_are_ignored_as_openai_and_vllm_ignore_them(stack: Stack) -> None:
    """guidellm sends stream_options.continuous_usage_stats; clients send metadata, store, chat_template_kwargs ...:
    each request is served as without them (a field this server knows is still checked)."""
    plain = stack.client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=6, temperature=0)
    extra = {"best_of_three": 1, "metadata": {"run": "a"}, "store": False, "parallel_tool_calls": True}
    lenient = stack.client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra
    )
    assert lenient.choices[0].text == plain.choices[0].text
    options: Any = {"include_usage": True, "continuous_usage_stats": True}  # (a key the client's types lack)
    streamed = stack.client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True, stream_options=options
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # continuous_usage_stats (vLLM's, what guidellm reads): every chunk its usage so far
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert len(counts) == len([c for c in chunks if c.choices]) and counts == sorted(counts) and counts[-1] == 6
    # A message's fields this server does not know (name, OpenAI's own) are ignored too; a content part's are not.
    named = [MESSAGES[0], MESSAGES[1] | {"name": "me", "weight": 1}]
    assert _chat(stack, named).choices[0].message.content == _chat(stack, MESSAGES).choices[0].message.content


def test_error_object_on_the_wire_and_unknown_model(stack: Stack) -> None:
    body = json.dumps({"model": stack.model, "prompt": PROMPT, "best_of": 3}).encode()
    request = urllib.request.Request(f"{stack.base_url}/v1/completions", body, {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    assert json.loads(info.value.read()) == {
        "error": {
            "message": "best_of=3 is not supported yet by this server",
            "type": "invalid_request_error",
            "param": "best_of",
            "code": "invalid_argument",
        }
    }
    with pytest.raises(openai.NotFoundError) as missing:
        stack.client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "model_not_found"


def test_body_over_max_request_bytes_is_400_before_it_is_read(stack: Stack) -> None:
    """A Content-Length beyond --max-request-bytes (4 MiB) is refused at once; not a byte of the body is sent."""
    conn = http.client.HTTPConnection(stack.base_url.removeprefix("http://"), timeout=10)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(5 << 20))
        conn.endheaders()
        reply = conn.getresponse()
        assert reply.status == 400
        error = json.loads(reply.read())["error"]
    finally:
        conn.close()
    assert error["type"] == "invalid_request_error" and "--max-request-bytes" in error["message"], error
    assert str(4 << 20) in error["message"], error


def test_chunked_body_is_refused_once_it_passes_max_request_bytes() -> None:
    """Without a Content-Length, `BodyLimit` counts what is read and refuses at the first byte beyond the limit."""
    app = FastAPI()
    app.add_exception_handler(ApiError, lambda _, exc: JSONResponse(exc.body, exc.status))

    @app.post("/v1/completions")
    async def read(request: Request) -> dict[str, int]:
        return {"read": len(await request.body())}

    async def post(chunks: list[bytes]) -> tuple[int, Any]:
        messages = iter(
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
        )
        sent: list[Any] = []

        async def receive() -> Any:
            return next(messages, {"type": "http.disconnect"})

        async def send(message: Any) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
        await BodyLimit(app, 10)(scope, receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    assert asyncio.run(post([b"12345", b"1234"])) == (200, {"read": 9})
    status, body = asyncio.run(post([b"12345", b"123456"]))
    assert status == 400 and "--max-request-bytes" in body["error"]["message"], body


def test_full_queue_is_429(stack: Stack, llama_workers: Workers) -> None:
    """One sequence per batch (two batches) and three waiting: a flood of twelve gets 429 for some."""

    def one(_: int) -> str:
        try:
            done = stack.client.completions.create(
                model=stack.model, prompt=PROMPT, max_tokens=30, extra_body={"ignore_eos": True}
            )
            return str(done.usage.completion_tokens if done.usage else None)
        except openai.RateLimitError as error:
            assert isinstance(error.body, dict) and "queue" in error.body["message"], error.body
            return "429"

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(one, range(12)))
    assert set(outcomes) == {"30", "429"}, outcomes
    assert_all_slots_free(llama_workers)


# --------------------------------------------------------------------------------------------- clients that go


def _wait_cancelled(stack: Stack, count: int) -> None:
    deadline = time.monotonic() + 15
    while stack.metric("minedraft_requests_total", finish_reason="cancelled") < count:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.1)


def test_client_gone_mid_stream_cancels_the_request(stack: Stack, llama_workers: Workers) -> None:
    before = stack.metric("minedraft_requests_total", finish_reason="cancelled")
    stream = stack.client.completions.create(
        model=stack.model, prompt=PROMPT, max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    _wait_cancelled(stack, int(before) + 1)
    assert_all_slots_free(llama_workers)

    # A client that stops waiting for a whole answer cancels it too.
    with pytest.raises(openai.APITimeoutError):
        stack.client.with_options(timeout=0.5).completions.create(
            model=stack.model, prompt=PROMPT, max_tokens=LONG, extra_body={"ignore_eos": True}
        )
    _wait_cancelled(stack, int(before) + 2)
    assert_all_slots_free(llama_workers)


# --------------------------------------------------------------------------------------------- gRPC


def test_grpc_messages_equal_apply_chat_template(stack: Stack) -> None:
    ids = chat_prompt_ids(_grpc_messages(MESSAGES), stack.tokenizer)
    assert ids == stack.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _grpc(stack, prompt="def f():", messages=_grpc_messages(MESSAGES))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in (info.value.details() or "")


def test_generate_cli_chat(stack: Stack, tmp_path: Path) -> None:
    expected = _grpc(stack, messages=_grpc_messages(MESSAGES))
    path = tmp_path / "messages.json"
    path.write_text(json.dumps(MESSAGES))
    common = ["generate", "--server", stack.coordinator.address, "--max-tokens", "12", "--ignore-eos", "--json"]
    for args in (
        ["--chat", "--message", f"system:{MESSAGES[0]['content']}", "--message", f"user:{MESSAGES[1]['content']}"],
        ["--chat", str(path)],
    ):
        run = subprocess.run(
            [sys.executable, "-m", "minedraft_app", *common, *args],
            cwd=REPO,
            env=SERVICE_ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)["token_ids"] == expected.token_ids
    bad = subprocess.run(
        [sys.executable, "-m", "minedraft_app", *common, "--chat", "--message", "no colon"],
        cwd=REPO,
        env=SERVICE_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "ROLE:TEXT" in bad.stderr and "Traceback" not in bad.stderr


def test_generate_cli_n(stack: Stack) -> None:
    """`generate --n 3 --json`: a JSON line a sample, by index; greedy samples are copies of the one completion."""
    expected = _grpc(stack, prompt=PROMPT)
    args = ["generate", "--server", stack.coordinator.address, "--prompt", PROMPT, "--max-tokens", "12"]
    run = subprocess.run(
        [sys.executable, "-m", "minedraft_app", *args, "--ignore-eos", "--json", "--n", "3"],
        cwd=REPO,
        env=SERVICE_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    # Every field of the proto's Usage, cached_prompt_tokens included
    assert set(lines[0]["usage"]) == set(generation_pb2.Usage.DESCRIPTOR.fields_by_name), lines[0]["usage"]
    assert all(line["token_ids"] == expected.token_ids and line["finish_reason"] == "length" for line in lines)


# --------------------------------------------------------------------------------------------- last: the drain


def test_draining_coordinator_is_503(stack: Stack) -> None:
    """SIGTERM drains: /health answers 503 and new requests get 503 while the admitted one finishes."""
    streamed: list[str] = []

    def read() -> None:
        for chunk in stack.client.completions.create(
            model=stack.model, prompt=PROMPT, max_tokens=LONG, stream=True, extra_body={"ignore_eos": True}
        ):
            streamed.append(chunk.choices[0].finish_reason or "")

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while not streamed:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    stack.coordinator.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    while _get(f"{stack.base_url}/health")[0] != 503:
        assert time.monotonic() < deadline, "health never turned 503"
        time.sleep(0.05)
    with pytest.raises(openai.InternalServerError) as info:
        stack.client.completions.create(model=stack.model, prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503 and isinstance(info.value.body, dict)
    assert "shutting down" in info.value.body["message"]
    reader.join(timeout=60)
    assert streamed[-1] == "length"  # the admitted request finished
    assert stack.coordinator.proc.wait(timeout=30) == 0
