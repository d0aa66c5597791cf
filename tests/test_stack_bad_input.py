"""Bad requests get INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) naming the problem; the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from stack import (
    MAX_MODEL_LEN,
    REPO,
    SERVICE_ENV,
    Service,
    Workers,
    assert_all_slots_free,
    generate,
    running_coordinator,
)

from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

K = 4
PROMPT = [5, 17, 42, 99, 7]
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Service]:
    """One batch of one and a queue of one: every bad input, the queue bound and the CLI run against it."""
    with running_coordinator(llama_workers, stack_logs, "psd", k=K, max_batch_size=1, max_queue_size=1) as service:
        yield service


@pytest.fixture(scope="module")
def vocab_size(llama_workers: Workers) -> int:
    from stack import worker_info

    return worker_info(llama_workers.target.address, "target").logits_size


def _params(**kwargs: object) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(**{"max_tokens": 4, **kwargs})  # type: ignore[arg-type]


def _good() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_params(ignore_eos=True))


BAD_INPUTS: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    # name: (GenerateRequest fields, words the message must contain)
    "empty prompt": ({"params": _params()}, ("prompt", "empty")),
    "empty text prompt": ({"prompt": "", "params": _params()}, ("prompt", "empty")),
    "prompt and prompt_token_ids": (
        {"prompt": "def f():", "prompt_token_ids": PROMPT, "params": _params()},
        ("prompt_token_ids", "not both"),
    ),
    "prompt_token_ids and messages": (
        {"prompt_token_ids": PROMPT, "messages": [generation_pb2.ChatMessage(role="user", content="hi")]},
        ("messages", "not both"),
    ),
    # The tiny pair's tokenizer has none (tests/test_http_api.py serves one that has).
    "messages without a chat template": (
        {"messages": [generation_pb2.ChatMessage(role="user", content="hi")], "params": _params()},
        ("chat template", "prompt_token_ids"),
    ),
    "prompt beyond context": ({"prompt_token_ids": PROMPT * 60, "params": _params()}, ("context",)),
    "prompt + max_tokens beyond context": (
        {"prompt_token_ids": PROMPT * 10, "params": _params(max_tokens=250)},
        ("max_tokens", "context"),
    ),
    "negative temperature": ({"prompt_token_ids": PROMPT, "params": _params(temperature=-0.5)}, ("temperature",)),
    "top_p above 1": ({"prompt_token_ids": PROMPT, "params": _params(top_p=1.5)}, ("top_p",)),
    "negative top_p": ({"prompt_token_ids": PROMPT, "params": _params(top_p=-0.1)}, ("top_p",)),
    # Zero is a value, not proto3's "unset": it would keep no token.
    "top_p 0": ({"prompt_token_ids": PROMPT, "params": _params(top_p=0.0)}, ("top_p", "(0, 1]")),
    "max_tokens 0": ({"prompt_token_ids": PROMPT, "params": _params(max_tokens=0)}, ("max_tokens", ">= 1")),
    "negative top_k": ({"prompt_token_ids": PROMPT, "params": _params(top_k=-1)}, ("top_k",)),
    "negative token id": ({"prompt_token_ids": [*PROMPT, -1], "params": _params()}, ("vocabulary", "-1")),
    "logprobs above 20": ({"prompt_token_ids": PROMPT, "params": _params(logprobs=21)}, ("logprobs", "at most 20")),
    "min_tokens above max_tokens": (
        {"prompt_token_ids": PROMPT, "params": _params(min_tokens=5)},
        ("min_tokens (5)", "max_tokens (4)"),
    ),
    "min_p above 1": ({"prompt_token_ids": PROMPT, "params": _params(min_p=1.5)}, ("min_p", "[0, 1]")),
    # Set to 0 is a value, not "unset" (1): it would divide by zero.
    "repetition_penalty 0": (
        {"prompt_token_ids": PROMPT, "params": _params(repetition_penalty=0.0)},
        ("repetition_penalty", "> 0"),
    ),
    "presence_penalty above 2": (
        {"prompt_token_ids": PROMPT, "params": _params(presence_penalty=2.5)},
        ("presence_penalty", "[-2, 2]"),
    ),
    "frequency_penalty below -2": (
        {"prompt_token_ids": PROMPT, "params": _params(frequency_penalty=-2.5)},
        ("frequency_penalty", "[-2, 2]"),
    ),
    # Limits, checked before any work (the coordinator's defaults)
    "prompt text over --max-prompt-bytes": (
        {"prompt": "a" * ((1 << 20) + 1), "params": _params()},
        ("--max-prompt-bytes", str((1 << 20) + 1), str(1 << 20)),
    ),
    "messages over --max-prompt-bytes": (
        {"messages": [generation_pb2.ChatMessage(role="user", content="é" * (1 << 19))], "params": _params()},
        ("--max-prompt-bytes", "messages"),
    ),
    "messages over --max-messages": (
        {"messages": [generation_pb2.ChatMessage(role="user", content="hi")] * 1025, "params": _params()},
        ("--max-messages", "1025", "1024"),
    ),
    "stop strings over --max-stop-strings": (
        {"prompt_token_ids": PROMPT, "params": _params(stop=[f"s{i}" for i in range(17)])},
        ("--max-stop-strings", "17", "16"),
    ),
    "stop string over --max-stop-string-bytes": (
        {"prompt_token_ids": PROMPT, "params": _params(stop=["ok", "x" * 257])},
        ("--max-stop-string-bytes", "257", "256"),
    ),
    "n above the limit": ({"prompt_token_ids": PROMPT, "params": _params(), "n": 17}, ("n must be at most 16",)),
    # Each sample waits in the queue on its own: two can never wait in a queue of one.
    "n beyond the queue": ({"prompt_token_ids": PROMPT, "params": _params(), "n": 2}, ("n=2", "queue of 1")),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_is_invalid_argument_and_the_next_request_works(name: str, coordinator: Service) -> None:
    fields, words = BAD_INPUTS[name]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(generate(coordinator.address, generation_pb2.GenerateRequest(**fields), timeout=30))  # type: ignore[arg-type]
    assert info.value.code() == INVALID, (name, info.value.code(), info.value.details())
    details = info.value.details() or ""
    assert all(w in details for w in words), f"{name}: message {details!r} should name {words}"
    done = asyncio.run(generate(coordinator.address, _good(), timeout=60))
    assert len(done.token_ids) == 4 and done.finish_reason == generation_pb2.FINISH_REASON_LENGTH


def test_token_id_beyond_the_vocabulary(coordinator: Service, vocab_size: int) -> None:
    request = generation_pb2.GenerateRequest(prompt_token_ids=[*PROMPT, vocab_size], params=_params())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(generate(coordinator.address, request, timeout=30))
    assert info.value.code() == INVALID
    assert "vocabulary" in (info.value.details() or "") and str(vocab_size) in (info.value.details() or "")
    assert len(asyncio.run(generate(coordinator.address, _good(), timeout=60)).token_ids) == 4


def test_edge_values_that_are_valid(coordinator: Service) -> None:
    """top_p unset is 1.0, as old clients send it; top_k 0 is off; a prompt that exactly fills the context is fine;
    max_tokens unset is 16."""
    room = MAX_MODEL_LEN - K
    unset = generation_pb2.SamplingParams(temperature=0.5, ignore_eos=True)
    assert not unset.HasField("top_p") and not unset.HasField("max_tokens")
    done = asyncio.run(
        generate(coordinator.address, generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=unset), 60)
    )
    assert len(done.token_ids) == 16
    for params, prompt in (
        (_params(top_p=1.0, top_k=0, temperature=0.0, ignore_eos=True), PROMPT),
        # The ends of the ranges of logprobs, min_tokens, min_p and the penalties
        (_params(logprobs=20, min_tokens=4, min_p=1.0, presence_penalty=-2, frequency_penalty=2), PROMPT),
        (_params(logprobs=0, repetition_penalty=0.01, ignore_eos=True), PROMPT),
        (_params(max_tokens=4, ignore_eos=True), [7] * (room - 4)),
    ):
        done = asyncio.run(
            generate(
                coordinator.address, generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params), timeout=60
            )
        )
        assert len(done.token_ids) == 4, params


def test_queue_bound_gives_resource_exhausted(coordinator: Service) -> None:
    """One running per batch (two batches) and one waiting: a flood of 16 gets RESOURCE_EXHAUSTED for some."""

    async def one() -> tuple[str, str]:
        try:
            request = generation_pb2.GenerateRequest(
                prompt_token_ids=PROMPT, params=_params(max_tokens=24, ignore_eos=True)
            )
            done = await generate(coordinator.address, request, timeout=60)
            return "OK", str(len(done.token_ids))
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, exc.details() or ""

    async def flood() -> list[tuple[str, str]]:
        return list(await asyncio.gather(*(one() for _ in range(16))))

    outcomes = asyncio.run(flood())
    codes = [code for code, _ in outcomes]
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    assert codes.count("OK") >= 1 and codes.count("RESOURCE_EXHAUSTED") >= 1, outcomes
    assert all(detail == "24" for code, detail in outcomes if code == "OK")
    assert all("queue" in detail for code, detail in outcomes if code == "RESOURCE_EXHAUSTED"), outcomes
    # Once the flood has drained, the server serves again.
    assert len(asyncio.run(generate(coordinator.address, _good(), timeout=60)).token_ids) == 4


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minedraft_app", "generate", *args],
        cwd=REPO,
        env=SERVICE_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generate_cli_reports_bad_input_without_traceback(coordinator: Service, vocab_size: int) -> None:
    for args, words in (((), ("top_k",)), (("--prompt-ids", f"1,2,{vocab_size}"), ("vocabulary",))):
        run = _cli("--server", coordinator.address, *(args or ("--prompt", "def f():", "--top-k", "-3")))
        assert run.returncode != 0, run
        assert "INVALID_ARGUMENT" in run.stderr and all(w in run.stderr for w in words), run.stderr
        assert "Traceback" not in run.stderr + run.stdout, run.stderr


def test_generate_cli_json(coordinator: Service) -> None:
    run = _cli(
        "--server",
        coordinator.address,
        "--prompt",
        "def main(argv):\n    ",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert set(out) == {"token_ids", "text", "finish_reason", "usage"}
    assert len(out["token_ids"]) == 6 and isinstance(out["text"], str) and out["finish_reason"] == "length"
    assert {
        "prompt_tokens",
        "completion_tokens",
        "draft_tokens",
        "accepted_tokens",
        "steps",
        "mean_accepted_length",
        "acceptance_rate",
        "accepted_per_position",
        "time_to_first_token_s",
        "time_per_output_token_s",
    } <= set(out["usage"])
    assert out["usage"]["completion_tokens"] == 6
    # With logprobs and a penalty: the tokens' logprobs, 3 top ones each, as gRPC gives them.
    flags = ["--max-tokens", "6", "--ignore-eos", "--json", "--logprobs", "3", "--repetition-penalty", "1.3"]
    run = _cli("--server", coordinator.address, "--prompt-ids", ",".join(map(str, PROMPT)), *flags)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    params = generation_pb2.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, repetition_penalty=1.3)
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=params)
    assert out["token_ids"] == asyncio.run(generate(coordinator.address, request, timeout=60)).token_ids
    assert len(out["logprobs"]) == 6 and all(len(lp["top"]) == 3 and lp["logprob"] <= 0 for lp in out["logprobs"])


def test_internal_calls_without_the_lease_are_refused_and_change_nothing(
    llama_workers: Workers, coordinator: Service
) -> None:
    """A client that reaches a worker but holds no lease (the coordinator holds it) gets FAILED_PRECONDITION naming
    the owner for every internal call, whatever it asks; the worker keeps what it held and the coordinator serves
    on. A Lease call of its own is refused too while the coordinator's lease is live."""
    from stack import worker_info

    from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    spec = common_pb2.SequenceSpec(seq_id=10**9, prompt_token_ids=[1, 2, 3], params=_params())
    target_calls = [
        lambda s: s.Prefill(target_pb2.TargetServicePrefillRequest(sequences=[spec]), timeout=10),
        lambda s: s.Verify(target_pb2.VerifyRequest(step_id=1, batch_id=0, seq_ids=[10**9]), timeout=10),
        lambda s: s.Release(target_pb2.TargetServiceReleaseRequest(seq_ids=list(range(1000))), timeout=10),
        lambda s: s.SetupChannel(target_pb2.TargetServiceSetupChannelRequest(channel="grpc"), timeout=10),
        lambda s: s.Prepare(target_pb2.TargetServicePrepareRequest(num_speculative_tokens=K), timeout=10),
        lambda s: s.Lease(target_pb2.TargetServiceLeaseRequest(owner="intruder"), timeout=10),
        lambda s: s.Lease(target_pb2.TargetServiceLeaseRequest(owner="intruder", epoch=1, give_up=True), timeout=10),
    ]
    draft_calls = [
        lambda s: s.Prefill(draft_pb2.DraftServicePrefillRequest(sequences=[spec]), timeout=10),
        lambda s: s.Release(draft_pb2.DraftServiceReleaseRequest(seq_ids=list(range(1000))), timeout=10),
        lambda s: s.SetupChannel(draft_pb2.DraftServiceSetupChannelRequest(channel="grpc"), timeout=10),
    ]
    assert llama_workers.draft is not None
    assert_all_slots_free(llama_workers)  # the tests before: their releases may still be on the way
    before = [
        worker_info(w.address, kind).free_blocks
        for w, kind in ((llama_workers.target, "target"), (llama_workers.draft, "draft"))
    ]
    for service, stub_type, calls in (
        (llama_workers.target, target_pb2_grpc.TargetServiceStub, target_calls),
        (llama_workers.draft, draft_pb2_grpc.DraftServiceStub, draft_calls),
    ):
        with grpc.insecure_channel(service.address) as channel:
            stub = stub_type(channel)
            for call in calls:
                try:
                    reply = call(stub)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
                    assert "holds this worker's lease" in (error.details() or ""), error.details()
                else:  # a give-up under another's lease is a no-op that says nothing
                    assert not reply.lease.owner
    after = [
        worker_info(w.address, kind).free_blocks
        for w, kind in ((llama_workers.target, "target"), (llama_workers.draft, "draft"))
    ]
    assert after == before
    assert len(asyncio.run(generate(coordinator.address, _good())).token_ids) == 4


async def _canary_gaps(address: str, during: asyncio.Future[tuple[float, str]]) -> list[float]:
    """The seconds between the messages of a normal stream that runs while `during` is awaited."""
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=_params(max_tokens=60, ignore_eos=True))
    gaps: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
        last = time.perf_counter()
        async for _ in call:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    await during
    return gaps[1:]  # the first waits for the prefill


async def _refused(address: str, request: generation_pb2.GenerateRequest, delay: float) -> tuple[float, str]:
    """Seconds until `request` (sent after `delay`) is refused, and the status's message."""
    await asyncio.sleep(delay)
    start = time.perf_counter()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(address, request, timeout=30)
    assert info.value.code() == INVALID, info.value
    return time.perf_counter() - start, info.value.details() or ""


def test_huge_prompt_is_refused_fast_while_others_stream(coordinator: Service) -> None:
    """A 2 MiB prompt is refused by its size, before any tokenizing, in well under a second; a stream running
    meanwhile never stalls."""

    async def run() -> tuple[list[float], tuple[float, str]]:
        huge = generation_pb2.GenerateRequest(prompt="def f():\n" * (2 << 17), params=_params())
        refusal = asyncio.ensure_future(_refused(coordinator.address, huge, 0.3))
        return await _canary_gaps(coordinator.address, refusal), refusal.result()

    gaps, (took, details) = asyncio.run(run())
    assert "--max-prompt-bytes" in details, details
    assert took < 1.0, took
    assert len(gaps) >= 50 and max(gaps) < 0.5, max(gaps)


def test_tokenizing_a_long_prompt_does_not_stall_other_streams(coordinator: Service) -> None:
    """A long prompt (384 KiB: about a second to tokenize) is tokenized off the event loop, then refused (beyond
    the context); on the loop, the canary would wait that whole second."""

    async def run() -> tuple[list[float], tuple[float, str]]:
        long = generation_pb2.GenerateRequest(prompt="x = 1\n" * ((384 << 10) // 6), params=_params())
        refusal = asyncio.ensure_future(_refused(coordinator.address, long, 0.3))
        return await _canary_gaps(coordinator.address, refusal), refusal.result()

    gaps, (took, details) = asyncio.run(run())
    assert "context" in details, details
    print(f"tokenizing took {took:.2f} s, the canary's longest gap {max(gaps) * 1000:.0f} ms")
    assert max(gaps) < max(0.5, took / 2), (max(gaps), took)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_request_over_max_request_bytes_is_refused_unread(coordinator: Service) -> None:
    """Beyond --max-request-bytes (4 MiB) gRPC itself refuses the message (RESOURCE_EXHAUSTED, its code for it),
    unread: a 5 MiB and a 64 MiB prompt leave the coordinator's memory as it was (it once grew to 13 GB on one)."""
    baseline = _rss_mib(coordinator.proc.pid)
    for size in (5 << 20, 64 << 20):
        request = generation_pb2.GenerateRequest(prompt="a" * size, params=_params())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(generate(coordinator.address, request, timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        assert str(4 << 20) in (info.value.details() or ""), info.value.details()
    grown = _rss_mib(coordinator.proc.pid) - baseline
    assert grown < 200, f"the coordinator grew by {grown:.0f} MiB"
    assert len(asyncio.run(generate(coordinator.address, _good(), timeout=60)).token_ids) == 4


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (lengths under 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


MALFORMED = {
    "prompt not UTF-8": _field(1, b"def \xff\xfe():"),
    "chat content not UTF-8": _field(5, _field(1, b"user") + _field(2, b"\xc3\x28")),
    "truncated": _field(1, b"def f():")[:-3],
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_protobuf_is_invalid_argument_without_traceback(name: str, coordinator: Service) -> None:
    before = len(coordinator.log_tail(10**9))

    async def send() -> None:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            call: grpc.aio.UnaryStreamMultiCallable[bytes, generation_pb2.GenerateResponse] = channel.unary_stream(
                "/minedraft.v1.GenerationService/Generate",
                request_serializer=None,
                response_deserializer=generation_pb2.GenerateResponse.FromString,
            )
            async for _ in call(MALFORMED[name], timeout=30):
                pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(send())
    assert info.value.code() == INVALID, (info.value.code(), info.value.details())
    assert "does not parse" in (info.value.details() or "") and "Error" not in (info.value.details() or "")
    log = coordinator.log_tail(10**9)[before:]
    assert "Traceback" not in log and " ERROR " not in log, log
    assert len(asyncio.run(generate(coordinator.address, _good(), timeout=60)).token_ids) == 4
