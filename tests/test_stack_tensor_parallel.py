"""A target service over two gloo ranks (real processes) serves what one rank serves, and fails fast without one.

Greedy output through the stack equals Hugging Face `generate()` in psd, sd and ar, and seeded sampled output equals
the one-rank target's; a rank killed mid-load ends every admitted request with UNAVAILABLE within seconds."""

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
    text_prompts,
    wait_all,
    wait_health,
    worker_args,
)

from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

BATCH = 4  # 8 requests over batches of 4: they queue, join and leave mid-flight


@pytest.fixture(scope="module")
def tp_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    """The tiny Llama pair with its target over two ranks (the draft whole)."""
    pair = tiny_pairs["llama"]
    target = spawn(
        "llama-target-tp2", [*worker_args("target", pair.target, BATCH), "--tensor-parallel-size", "2"], stack_logs
    )
    draft = spawn("llama-draft-for-tp2", worker_args("draft", pair.draft, BATCH), stack_logs)
    workers = Workers(pair, target, draft, BATCH)
    try:
        wait_all([target, draft])
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def greedy(tiny_pairs: TinyPairs) -> tuple[list[generation_pb2.GenerateRequest], list[list[int]]]:
    """Requests and what `generate()` of the target alone continues them with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pairs["llama"].target, dtype=torch.float32)
    requests, expected = [], []
    for i, prompt in enumerate(text_prompts(tiny_pairs.tokenizer, 8, 4, 40, seed=42)):
        budget = 6 + 3 * i
        requests.append(
            generation_pb2.GenerateRequest(
                prompt_token_ids=prompt, params=generation_pb2.SamplingParams(max_tokens=budget, ignore_eos=True)
            )
        )
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False)
        expected.append(out[0, len(prompt) :].tolist())
    return requests, expected


@pytest.mark.parametrize("mode", ["psd", "sd", "ar"])
def test_two_ranks_greedy_match_generate(
    mode: str,
    tp_workers: Workers,
    greedy: tuple[list[generation_pb2.GenerateRequest], list[list[int]]],
    stack_logs: Path,
) -> None:
    requests, expected = greedy
    with running_coordinator(tp_workers, stack_logs, mode, max_batch_size=BATCH) as coordinator:
        got = asyncio.run(generate_all(coordinator.address, requests))
    assert got == expected
    assert_all_slots_free(tp_workers)


def test_two_ranks_sample_as_one_rank(
    tp_workers: Workers, llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path
) -> None:
    """Seeded sampled requests (the draft's probabilities cross the channel to rank 0, which hands them on)."""
    requests = mixed_requests(tiny_pairs.tokenizer)
    results = []
    for workers in (llama_workers, tp_workers):
        with running_coordinator(workers, stack_logs, "psd", max_batch_size=BATCH) as coordinator:
            results.append(asyncio.run(generate_all(coordinator.address, requests)))
    assert results[0] == results[1]


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


def test_a_killed_rank_ends_requests_with_unavailable(
    tp_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path
) -> None:
    """Last in this module: the target stops for good (rank 0 exits for its supervisor to start the group anew)."""
    found = re.search(r"rank 1 of 2 started as pid (\d+)", tp_workers.target.log_tail(10**6))
    assert found, tp_workers.target.log_tail()
    params = generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    requests = [
        generation_pb2.GenerateRequest(prompt_token_ids=p, params=params)
        for p in text_prompts(tiny_pairs.tokenizer, 6, 4, 20, seed=5)
    ]
    with running_coordinator(tp_workers, stack_logs, "psd", max_batch_size=BATCH) as coordinator:
        *ended, seconds = asyncio.run(_kill_rank_while_streaming(coordinator.address, requests, int(found.group(1))))
        assert ended == ["UNAVAILABLE"] * len(requests), ended
        assert float(seconds) < 10, seconds
        wait_health(coordinator.address, health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
    assert tp_workers.target.proc.wait(timeout=15) == 1
    assert "tensor-parallel tp-rank-1" in tp_workers.target.log_tail(10**6)
