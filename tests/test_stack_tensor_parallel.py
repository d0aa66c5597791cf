"""A target service over two gloo ranks (real processes) serves what one rank serves, and fails fast without one.

Greedy output through the stack equals Hugging Face `generate()` (Llama in psd, sd and ar; Qwen3 in psd and ar), and
seeded sampled output equals the one-rank target's; a rank killed mid-load ends every admitted request with
UNAVAILABLE within seconds."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2
from stack import (
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate_all,
    mixed_requests,
    running_coordinator,
    spawn,
    stop_all,
    text_prompts,
    wait_all,
    wait_health,
    worker_args,
)

from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

ARCHS = ("llama", "qwen3")
BATCH = 4  # 8 requests over batches of 4: they queue, join and leave mid-flight


@pytest.fixture(scope="module")
def tp_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[dict[str, Workers]]:
    """Llama and Qwen3 targets over two ranks each, and one draft (the Llama pair's, whole: both share its
    tokenizer), started at once."""
    targets = {
        arch: spawn(
            f"{arch}-target-tp2",
            [*worker_args("target", tiny_pairs[arch].target, BATCH), "--tensor-parallel-size", "2"],
            stack_logs,
        )
        for arch in ARCHS
    }
    draft = spawn("llama-draft-for-tp2", worker_args("draft", tiny_pairs["llama"].draft, BATCH), stack_logs)
    try:
        wait_all([*targets.values(), draft])
        yield {arch: Workers(tiny_pairs[arch], target, draft, BATCH) for arch, target in targets.items()}
    finally:
        stop_all([draft, *targets.values()])


@pytest.fixture(scope="module")
def greedy(tiny_pairs: TinyPairs) -> dict[str, tuple[list[generation_pb2.GenerateRequest], list[list[int]]]]:
    """Per architecture: requests, and what `generate()` of the target alone continues them with."""
    from transformers import AutoModelForCausalLM

    prompts = text_prompts(tiny_pairs.tokenizer, 8, 4, 40, seed=42)
    requests = [
        generation_pb2.GenerateRequest(
            prompt_token_ids=prompt, params=generation_pb2.SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)
        )
        for i, prompt in enumerate(prompts)
    ]
    cases = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(tiny_pairs[arch].target, dtype=torch.float32)
        model.generation_config.eos_token_id = None  # (the requests ignore EOS)
        expected = []
        for request in requests:
            ids = torch.tensor([list(request.prompt_token_ids)])
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=request.params.max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            expected.append(out[0, ids.shape[1] :].tolist())
        cases[arch] = (requests, expected)
    return cases


# Llama's psd is in the last test, on the coordinator that then sees a rank killed; Qwen3's sd runs the very verify
# its psd does (left out: each case costs a coordinator's start).
@pytest.mark.parametrize(("arch", "mode"), [("llama", "sd"), ("llama", "ar"), ("qwen3", "psd"), ("qwen3", "ar")])
def test_two_ranks_greedy_match_generate(
    arch: str,
    mode: str,
    tp_workers: dict[str, Workers],
    greedy: dict[str, tuple[list[generation_pb2.GenerateRequest], list[list[int]]]],
    stack_logs: Path,
) -> None:
    requests, expected = greedy[arch]
    with running_coordinator(tp_workers[arch], stack_logs, mode, max_batch_size=BATCH) as coordinator:
        got = asyncio.run(generate_all(coordinator.address, requests))
    assert got == expected
    assert_all_slots_free(tp_workers[arch])


async def _kill_rank_while_streaming(
    address: str, requests: list[generation_pb2.GenerateRequest], pid: int
) -> list[str]:
    """Kill rank `pid` once every request has streamed a message; how each stream ended and when."""
    started = [asyncio.Event() for _ in requests]

    async def stream(request: generation_pb2.GenerateRequest, first: asyncio.Event) -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
            try:
                async for message in call:
                    first.set()
                    if message.finish_reason:
                        return generation_pb2.FinishReason.Name(message.finish_reason)
            except grpc.aio.AioRpcError as exc:
                first.set()
                return exc.code().name
        return "no finish"

    tasks = [asyncio.create_task(stream(r, e)) for r, e in zip(requests, started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    ended = list(await asyncio.gather(*tasks))
    return [*ended, f"{time.monotonic() - killed:.1f}"]


def test_psd_then_a_killed_rank(
    tp_workers: dict[str, Workers],
    llama_workers: Workers,
    greedy: dict[str, tuple[list[generation_pb2.GenerateRequest], list[list[int]]]],
    tiny_pairs: TinyPairs,
    stack_logs: Path,
) -> None:
    """Llama in psd: greedy output as `generate()`'s, seeded sampled output (the draft's probabilities cross the
    channel to rank 0, which hands them on) as the one-rank target's; then rank 1 killed mid-load ends every request
    with UNAVAILABLE within 10 s. Last in this module: the target stops for good (rank 0 exits, for its supervisor to
    start the group anew)."""
    sampled = mixed_requests(tiny_pairs.tokenizer)
    with running_coordinator(llama_workers, stack_logs, "psd", max_batch_size=BATCH) as coordinator:
        one_rank = asyncio.run(generate_all(coordinator.address, sampled))
    workers = tp_workers["llama"]
    found = re.search(r"rank 1 of 2 started as pid (\d+)", workers.target.log_tail(10**6))
    assert found, workers.target.log_tail()
    params = generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    long = [
        generation_pb2.GenerateRequest(prompt_token_ids=p, params=params)
        for p in text_prompts(tiny_pairs.tokenizer, 6, 4, 20, seed=5)
    ]
    requests, expected = greedy["llama"]
    with running_coordinator(workers, stack_logs, "psd", max_batch_size=BATCH) as coordinator:
        assert asyncio.run(generate_all(coordinator.address, requests)) == expected
        assert asyncio.run(generate_all(coordinator.address, sampled)) == one_rank
        assert_all_slots_free(workers)
        *ended, seconds = asyncio.run(_kill_rank_while_streaming(coordinator.address, long, int(found.group(1))))
        assert ended == ["UNAVAILABLE"] * len(long), ended
        assert float(seconds) < 10, seconds
        wait_health(coordinator.address, health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
    assert workers.target.proc.wait(timeout=15) == 1
    assert "tensor-parallel tp-rank-1" in workers.target.log_tail(10**6)
