"""Cancelled streams free their KV rows on both workers: a client going away leaks nothing; and `n` samples of one
prompt (GenerateRequest.n) on the same coordinator."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


# --------------------------------------------------------------------------------------------- n samples


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    usage: generation_pb2.Usage | None = None
    after_finish: int = 0  # messages of this sample after its final one (must stay 0)


async def _samples(address: str, request: generation_pb2.GenerateRequest) -> list[Sample]:
    """One Generate call's samples, by index."""
    samples: dict[int, Sample] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        async for message in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120):
            sample = samples.setdefault(message.index, Sample())
            sample.after_finish += bool(sample.finish_reason)
            sample.token_ids += message.token_ids
            if message.finish_reason:
                sample.finish_reason, sample.usage = message.finish_reason, message.usage
    assert sorted(samples) == list(range(max(request.n, 1))), sorted(samples)
    return [samples[i] for i in range(len(samples))]


def _n_request(prompt: list[int], n: int, max_tokens: int = 12, **params: Any) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=sampling, n=n)


def test_n_greedy_samples_are_copies_of_the_one_completion(coordinator: Service, tiny_pairs: TinyPairs) -> None:
    prompt = text_prompts(tiny_pairs.tokenizer, 1, 20, 20, seed=31)[0]
    (one,) = asyncio.run(_samples(coordinator.address, _n_request(prompt, 0)))
    three = asyncio.run(_samples(coordinator.address, _n_request(prompt, 3)))
    assert [s.token_ids for s in three] == [one.token_ids] * 3 and len(one.token_ids) == 12
    for sample in three:  # each sample's last message: its own finish reason and usage
        assert sample.finish_reason == generation_pb2.FINISH_REASON_LENGTH and sample.after_finish == 0
        assert sample.usage is not None and sample.usage.completion_tokens == 12
        assert sample.usage.prompt_tokens == len(prompt)


def test_n_seeded_samples_differ_and_a_rerun_reproduces_them(coordinator: Service, tiny_pairs: TinyPairs) -> None:
    prompt = text_prompts(tiny_pairs.tokenizer, 1, 12, 12, seed=32)[0]
    request = _n_request(prompt, 3, 16, temperature=1.0, seed=4242)
    first = [s.token_ids for s in asyncio.run(_samples(coordinator.address, request))]
    again = [s.token_ids for s in asyncio.run(_samples(coordinator.address, request))]
    assert first == again
    for i in range(3):
        for j in range(i + 1, 3):
            assert sum(a != b for a, b in zip(first[i], first[j])) >= 4, (i, j, first)
    # Sample i is seeded with seed + i: what a request of one sample with that seed gives.
    (alone,) = asyncio.run(_samples(coordinator.address, _n_request(prompt, 1, 16, temperature=1.0, seed=4243)))
    assert alone.token_ids == first[1]


def test_cancelling_a_call_frees_all_its_samples(coordinator: Service, llama_workers: Workers) -> None:
    async def cancel_after_first() -> None:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(_n_request([5, 6, 7, 8], 4, 200))
            async for _ in call:
                break
            call.cancel()

    asyncio.run(cancel_after_first())
    assert_all_slots_free(llama_workers, timeout=15)
