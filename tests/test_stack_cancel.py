"""Cancelled streams free their KV rows on both workers: a client going away leaks nothing."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from stack import (
    Service,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate,
    running_coordinator,
    text_prompts,
)

from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

NUM_CANCELLED = 100
BATCH = 8


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Service]:
    with running_coordinator(llama_workers, stack_logs, "psd", max_batch_size=BATCH) as service:
        yield service


def _request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    # Long enough that nothing finishes before its client gives up (context 256, k 4).
    params = generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


async def _cancel_after_first(stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int], delay: float) -> str:
    await asyncio.sleep(delay)
    call = stub.Generate(_request(prompt))
    async for _ in call:
        break
    call.cancel()
    return "cancelled"


async def _short_deadline(
    stub: generation_pb2_grpc.GenerationServiceStub, prompt: list[int], delay: float, deadline: float
) -> str:
    await asyncio.sleep(delay)
    try:
        async for _ in stub.Generate(_request(prompt), timeout=deadline):
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return "OK"


async def _cancel_many(address: str, prompts: list[list[int]]) -> list[str]:
    rng = random.Random(11)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        tasks = []
        for i, prompt in enumerate(prompts):
            delay = rng.uniform(0.0, 2.0)  # some are cancelled in the queue, some while running, some joining
            if i % 2:
                tasks.append(_short_deadline(stub, prompt, delay, rng.uniform(0.05, 0.6)))
            else:
                tasks.append(_cancel_after_first(stub, prompt, delay))
        return list(await asyncio.gather(*tasks))


def test_cancelled_streams_free_every_kv_row(
    coordinator: Service, llama_workers: Workers, tiny_pairs: TinyPairs
) -> None:
    prompts = text_prompts(tiny_pairs.tokenizer, NUM_CANCELLED, 4, 40, seed=5)
    outcomes = asyncio.run(_cancel_many(coordinator.address, prompts))
    assert outcomes.count("cancelled") == NUM_CANCELLED // 2
    assert set(outcomes) <= {"cancelled", "DEADLINE_EXCEEDED", "CANCELLED"}, set(outcomes)
    assert_all_slots_free(llama_workers, timeout=15)

    # The server still works, and that request too leaves the workers clean.
    done = asyncio.run(
        generate(
            coordinator.address,
            generation_pb2.GenerateRequest(
                prompt_token_ids=prompts[0], params=generation_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
            ),
        )
    )
    assert len(done.token_ids) == 8
    assert done.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert_all_slots_free(llama_workers, timeout=15)
