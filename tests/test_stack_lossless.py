"""Greedy output through the whole gRPC stack equals Hugging Face `generate()` of the target alone, in every mode."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from conftest import hf_processed_greedy
from stack import (
    Completion,
    Service,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    assert_same_top,
    coordinator_args,
    generate,
    in_process_coordinator,
    run_async,
    spawn,
    start_workers,
    stop_all,
    text_prompts,
    wait_all,
)

from minedraft.engine.models import load_tokenizer
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

NUM_REQUESTS = 32
COORDINATOR_BATCH = 6  # 32 requests > 2 x 6: requests queue, join and leave mid-flight
K = {"llama": 4, "gpt2": 3}
EOS = 0
MAX_PREFILL_TOKENS = 160


@dataclass
class Case:
    prompt_ids: list[int]
    as_text: str | None  # sent as text (tokenized by the server) when set
    max_tokens: int
    ignore_eos: bool
    delay: float
    expected: list[int]
    expected_finish: int


def _reference(model_dir: Path, prompts: list[list[int]], budgets: list[int]) -> list[list[int]]:
    """HF greedy continuations, EOS not stopping them (stops are applied to a copy later)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        with torch.inference_mode():
            for prompt, budget in zip(prompts, budgets):
                ids = torch.tensor([prompt])
                gen = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=budget,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=EOS,
                )
                out.append(gen[0, len(prompt) :].tolist())
    finally:
        torch.set_num_threads(threads)
    return out


def _cases(pairs: TinyPairs, arch: str) -> list[Case]:
    from transformers import AutoTokenizer

    pair = pairs[arch]
    tokenizer = AutoTokenizer.from_pretrained(pair.target)  # what the coordinator tokenizes with
    rng = random.Random(7 if arch == "llama" else 8)
    raw = text_prompts(tokenizer, NUM_REQUESTS, 4, 80, seed=rng.randrange(1 << 30))
    texts: list[str | None] = []
    prompts: list[list[int]] = []
    for i, ids in enumerate(raw):
        if i % 2:  # odd requests: text, tokenized by the server; the reference uses the same tokenization
            text = str(tokenizer.decode(ids))
            texts.append(text)
            prompts.append(tokenizer.encode(text))
        else:
            texts.append(None)
            prompts.append(ids)
    budgets = [rng.randint(2, 32) for _ in range(NUM_REQUESTS)]
    budgets[0], budgets[1] = 1, 32  # a one-token request finishes at prefill
    references = _reference(pair.target, prompts, budgets)
    cases = []
    for i, (prompt, as_text, budget, ref) in enumerate(zip(prompts, texts, budgets, references)):
        ignore_eos = i % 4 < 2
        expected, finish = ref, generation_pb2.FINISH_REASON_LENGTH
        if not ignore_eos and EOS in ref:  # compare up to and including EOS
            expected, finish = ref[: ref.index(EOS) + 1], generation_pb2.FINISH_REASON_STOP
        cases.append(Case(prompt, as_text, budget, ignore_eos, rng.uniform(0.0, 1.5), expected, finish))
    return cases


@pytest.fixture(scope="module")
def gpt2_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    workers = start_workers(tiny_pairs["gpt2"], stack_logs)
    try:
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def all_workers(llama_workers: Workers, gpt2_workers: Workers) -> dict[str, Workers]:
    return {"llama": llama_workers, "gpt2": gpt2_workers}


@pytest.fixture(scope="module")
def cases(tiny_pairs: TinyPairs) -> dict[str, list[Case]]:
    return {arch: _cases(tiny_pairs, arch) for arch in ("llama", "gpt2")}


async def _send(address: str, case: Case) -> Completion:
    await asyncio.sleep(case.delay)
    params = generation_pb2.SamplingParams(max_tokens=case.max_tokens, temperature=0.0, ignore_eos=case.ignore_eos)
    request = generation_pb2.GenerateRequest(params=params)
    if case.as_text is not None:
        request.prompt = case.as_text
    else:
        request.prompt_token_ids.extend(case.prompt_ids)
    return await generate(address, request, timeout=300)


async def _run_all(addresses: dict[str, str], cases: dict[str, list[Case]]) -> dict[str, list[Completion]]:
    tasks = {arch: [asyncio.create_task(_send(addresses[arch], c)) for c in cases[arch]] for arch in addresses}
    return {arch: list(await asyncio.gather(*ts)) for arch, ts in tasks.items()}


@pytest.mark.parametrize("mode", ["psd", "sd", "ar"])
def test_greedy_matches_target_alone(
    mode: str, all_workers: dict[str, Workers], cases: dict[str, list[Case]], stack_logs: Path
) -> None:
    # One coordinator per architecture, started together (a start costs seconds), each on its own worker pair.
    coordinators: dict[str, Service] = {}
    try:
        for arch, workers in all_workers.items():
            # Prompts of 4-80 tokens: bursts are admitted a few at a time, between running steps.
            args = coordinator_args(
                workers,
                mode,
                k=K[arch],
                max_batch_size=COORDINATOR_BATCH,
                extra=["--max-prefill-tokens", str(MAX_PREFILL_TOKENS)],
            )
            coordinators[arch] = spawn(f"coordinator-{arch}-{mode}", args, stack_logs)
        wait_all(list(coordinators.values()))
        results = asyncio.run(_run_all({a: c.address for a, c in coordinators.items()}, cases))
    finally:
        stop_all(list(coordinators.values()))

    for arch, completions in results.items():
        mismatches = []
        for i, (case, got) in enumerate(zip(cases[arch], completions)):
            if got.token_ids != case.expected or got.finish_reason != case.expected_finish:
                mismatches.append(
                    f"request {i} (prompt {len(case.prompt_ids)} tokens, max {case.max_tokens}): "
                    f"got {got.token_ids} ({got.finish_reason}), want {case.expected} "
                    f"({case.expected_finish})"
                )
            assert got.usage.completion_tokens == len(got.token_ids)
            assert got.usage.prompt_tokens == len(case.prompt_ids)
        assert not mismatches, f"{arch}/{mode}: {len(mismatches)} of {len(completions)} differ:\n" + "\n".join(
            mismatches[:5]
        )
        drafted = sum(c.usage.draft_tokens for c in completions)
        accepted = sum(c.usage.accepted_tokens for c in completions)
        if mode == "ar":
            assert drafted == 0
        else:
            assert drafted > 0
            if arch == "gpt2":  # its draft is the target's first layer: some drafts must have been accepted
                assert accepted > 0
    # The coordinators released every sequence before stopping: the next test finds the workers clean.
    for workers in all_workers.values():
        assert_all_slots_free(workers)


def test_compiled_services_match_target_alone(
    tiny_pairs: TinyPairs, cases: dict[str, list[Case]], stack_logs: Path
) -> None:
    """With `--compile` (compiled layers, and the target's acceptance and commit, warmed up when the coordinator
    connects), PSD through the services still gives `generate()`'s tokens."""
    some = cases["llama"][:12]  # a prefill-only request, text and token prompts, EOS stops, joins mid-flight
    workers = start_workers(tiny_pairs["llama"], stack_logs, extra=["--compile"])
    coordinator = None
    try:
        coordinator = spawn(
            "coordinator-llama-compiled",
            coordinator_args(workers, "psd", k=K["llama"], max_batch_size=COORDINATOR_BATCH),
            stack_logs,
        )
        wait_all([coordinator], timeout=600)
        got = asyncio.run(_run_all({"llama": coordinator.address}, {"llama": some}))["llama"]
        target_log = workers.target.log_tail(10**7)
    finally:
        stop_all([coordinator])
        workers.stop()
    assert "acceptance and commit compiled for k=4" in target_log
    assert [(c.token_ids, c.finish_reason) for c in got] == [(c.expected, c.expected_finish) for c in some]


# Each alone, greedy, as SamplingParams takes them (min_tokens holds back a stop token id the target emits early)
PENALTIES: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.7, "logprobs": 5},
    "presence": {"presence_penalty": 2.0},
    "frequency": {"frequency_penalty": 0.8},
    "min_tokens": {"min_tokens": 10},
    "min_p": {"min_p": 0.3},
}
LOGPROB_TOKENS = 16


def _logprob_requests(
    prompts: list[list[int]], target: Any, hf_reference: Any
) -> tuple[list[generation_pb2.GenerateRequest], list[list[int]]]:
    """Greedy requests asking for logprobs (0, 4 and 20 top ones), then a request per penalty and prompt; each
    with the tokens HF `generate()` gives (with the penalty's logits processor)."""
    requests, expected = [], []
    plain = [hf_reference(target, p, LOGPROB_TOKENS) for p in prompts]
    for prompt, top, tokens in zip(prompts, (0, 4, 20), plain):
        params = generation_pb2.SamplingParams(max_tokens=LOGPROB_TOKENS, ignore_eos=True, logprobs=top)
        requests.append(generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params))
        expected.append(tokens)
    for name, fields in PENALTIES.items():
        changed = False
        for prompt, tokens in zip(prompts[:2], plain):
            stops = (tokens[2],) if name == "min_tokens" else ()
            config = SamplingConfig(max_tokens=LOGPROB_TOKENS, stop_token_ids=stops, **fields)
            want = hf_processed_greedy(target, prompt, config, [EOS])
            plain_config = SamplingConfig(max_tokens=LOGPROB_TOKENS, stop_token_ids=stops)
            changed |= want != hf_processed_greedy(target, prompt, plain_config, [EOS])
            params = generation_pb2.SamplingParams(max_tokens=LOGPROB_TOKENS, stop_token_ids=stops, **fields)
            requests.append(generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params))
            expected.append(want)
        # (Greedy min_p keeps the argmax: nothing to see there but that it runs.)
        assert changed or name == "min_p", f"{name} changes nothing here: the test would not see it"
    return requests, expected


# Structured outputs: (kind, source, compact JSON) -> the field of StructuredOutput that asks for it
GRAMMARS = [
    (
        "json_schema",
        '{"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", '
        '"items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["id", "tags"], "additionalProperties": false}',
        True,
    ),
    ("regex", r"(if|while) [a-z]{1,6}(\.[a-z]{1,6})?:", False),
    ("grammar", 'root ::= "return " value\nvalue ::= [0-9]+ | "None" | "self." [a-z_]+', False),
]


def _grammar_requests(
    prompts: list[list[int]], target: Any, tokenizer: Any
) -> tuple[list[generation_pb2.GenerateRequest], list[list[int]]]:
    """Greedy requests constrained by a JSON schema, a regex and an EBNF grammar (the regex's with logprobs), each
    with the tokens HF `generate()` gives with the same grammar as a logits processor."""
    requests, expected = [], []
    for prompt, (kind, source, compact) in zip(prompts, GRAMMARS):
        want = hf_processed_greedy(
            target, prompt, SamplingConfig(max_tokens=40, grammar=(kind, source, compact)), [EOS], tokenizer
        )
        assert want[-1] == EOS, f"{kind}: the grammar does not end within the test's tokens"
        output = generation_pb2.StructuredOutput(disable_any_whitespace=compact)
        setattr(output, kind, source)
        params = generation_pb2.SamplingParams(
            max_tokens=40, structured_output=output, logprobs=3 if kind == "regex" else None
        )
        requests.append(generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params))
        expected.append(want)
    return requests, expected


Reported = tuple[list[int], list[tuple[float, list[tuple[int, float]]]], int]


async def _logprobs_run(address: str, requests: list[generation_pb2.GenerateRequest]) -> list[Reported]:
    """Each request's tokens, its messages' logprobs ((logprob, [(id, logprob), ...]) per token), its drafts."""

    async def one(request: generation_pb2.GenerateRequest) -> Reported:
        tokens: list[int] = []
        logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        async with grpc.aio.insecure_channel(address) as channel:
            async for message in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120):
                assert len(message.logprobs) in (0, len(message.token_ids))
                tokens += message.token_ids
                logprobs += [(lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in message.logprobs]
        return tokens, logprobs, message.usage.draft_tokens

    return list(await asyncio.gather(*(one(r) for r in requests)))


def test_logprobs_and_penalties_through_the_services(llama_workers: Workers, hf_reference: Any) -> None:
    """Coordinators in this process over the session's Llama workers, psd and sd drafting every step, and ar:
    greedy output with each penalty, and with a grammar (structured outputs), equals HF `generate()` with the same
    logits processor in every mode, and the logprobs through psd and sd equal the target alone's (ar) within 1e-5,
    drafted positions included (without penalties: log_softmax of the HF model's own logits)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(llama_workers.pair.target), dtype=torch.float32)
    tokenizer = load_tokenizer(str(llama_workers.pair.target))
    prompts = text_prompts(tokenizer, 3, 6, 30, seed=5)
    requests, expected = _logprob_requests(prompts, target, hf_reference)
    constrained, constrained_expected = _grammar_requests(prompts, target, tokenizer)
    requests, expected = requests + constrained, expected + constrained_expected

    async def run(mode: str) -> list[Reported]:
        async with in_process_coordinator(llama_workers, mode=mode, speculation="always") as (address, _):
            return await _logprobs_run(address, requests)

    results = {mode: run_async(run(mode)) for mode in ("ar", "sd", "psd")}
    for mode, done in results.items():
        assert [tokens for tokens, _, _ in done] == expected, mode
        assert (sum(drafts for _, _, drafts in done) > 0) == (mode != "ar"), mode
    for mode in ("sd", "psd"):
        for request, tokens, (_, got, _), (_, want, _) in zip(requests, expected, results[mode], results["ar"]):
            assert len(got) == len(want) == (len(tokens) if request.params.HasField("logprobs") else 0)
            for (lp, top), (lp_ar, top_ar) in zip(got, want):
                assert abs(lp - lp_ar) < 1e-5, mode
                assert len(top) == request.params.logprobs
                assert_same_top(top, top_ar)
    for prompt, (tokens, logprobs, _) in zip(prompts, results["psd"]):  # the requests without penalties
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        assert len(logprobs) == len(tokens)
        assert torch.allclose(torch.tensor([lp for lp, _ in logprobs]), chosen, atol=1e-5)
    assert_all_slots_free(llama_workers)
