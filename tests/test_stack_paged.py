"""The paged KV cache through the services: preemption under a small pool, prefix reuse, no block ever leaked."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from reference import hf_greedy
from stack import (
    Service,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate,
    in_process_coordinator,
    running_coordinator,
    start_workers,
    text_prompts,
    worker_info,
)

from minedraft.observability.metrics import CoordinatorMetrics
from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

# KV cache per worker: 16 blocks of 16 tokens for the tiny Llama target (512 bytes a token), 4x that for its draft;
# 8 sequences of ~100 tokens need ~56 target blocks at once, so the coordinator must preempt. One of them is the
# trash block: the target holds 240 tokens, less than --max-model-len 256.
SMALL_POOL_GIB = 16 * 16 * 512 / 2**30
BATCH = 4


@pytest.fixture(scope="module")
def small_pool(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    workers = start_workers(tiny_pairs["llama"], stack_logs, extra=["--kv-cache-memory", str(SMALL_POOL_GIB)])
    try:
        yield workers
    finally:
        workers.stop()


@pytest.fixture(scope="module")
def coordinator(small_pool: Workers, stack_logs: Path) -> Iterator[Service]:
    with running_coordinator(small_pool, stack_logs, "psd", max_batch_size=BATCH, max_queue_size=1200) as service:
        yield service


def _greedy(prompt: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


def _reference(model_dir: Path, prompts: list[list[int]], budget: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_greedy(model, prompt, budget) for prompt in prompts]


def test_the_pool_is_what_the_memory_allows(small_pool: Workers) -> None:
    info = worker_info(small_pool.target.address, "target")
    assert (info.block_size, info.num_blocks, info.free_blocks) == (16, 15, 15)
    assert info.max_model_len == 240  # lowered: one sequence must fit
    assert "max_model_len lowered from 256 to 240 tokens" in small_pool.target.log_tail(10**6)


def test_a_pool_too_small_for_the_load_still_completes_every_request_losslessly(
    coordinator: Service, small_pool: Workers, tiny_pairs: TinyPairs
) -> None:
    prompts = text_prompts(tiny_pairs.tokenizer, 12, 50, 80, seed=3)

    async def run() -> list[list[int]]:
        done = await asyncio.gather(*(generate(coordinator.address, _greedy(p, 40)) for p in prompts))
        return [d.token_ids for d in done]

    outputs = asyncio.run(run())
    assert outputs == _reference(small_pool.pair.target, prompts, 40)
    preempted = sum(
        int(n) for n in re.findall(r"KV cache full: (\d+) sequences preempted", coordinator.log_tail(10**7))
    )
    assert preempted > 0, "the load never ran short of blocks: the test proves nothing"
    assert_all_slots_free(small_pool, timeout=15)


def test_a_prompt_larger_than_the_pool_is_refused(coordinator: Service, small_pool: Workers) -> None:
    """The pool holds 240 tokens: less the k draft positions, 236 for a prompt and its output."""

    async def run() -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(coordinator.address, _greedy(list(range(1, 300)), 4))
        return caught.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "the prompt has 299 tokens; this server's context is 236 tokens" in (error.details() or "")


def test_a_shared_prefix_is_prefilled_once_and_decodes_the_same(
    coordinator: Service, small_pool: Workers, tiny_pairs: TinyPairs
) -> None:
    prefix = text_prompts(tiny_pairs.tokenizer, 1, 70, 70, seed=8)[0]
    prompts = [prefix + [5, 6], prefix + [7, 8, 9]]
    first = asyncio.run(generate(coordinator.address, _greedy(prompts[0], 8)))
    second = asyncio.run(generate(coordinator.address, _greedy(prompts[1], 8)))
    assert first.usage.cached_prompt_tokens in (0, 64)  # (an earlier test may have left the prefix cached)
    assert second.usage.cached_prompt_tokens == 64  # the 4 full blocks of the 70 shared tokens
    assert [first.token_ids, second.token_ids] == _reference(small_pool.pair.target, prompts, 8)


def test_a_cold_burst_is_admitted_at_once_and_computes_its_prompt_once(
    llama_workers: Workers, hf_reference: Any
) -> None:
    """Eight samples of one 200-token prompt nothing has cached yet, under --max-prefill-tokens 400: the target says
    its prefix caching is on (GetInfo), so the coordinator counts the blocks the first sample computes as cached for
    the others and admits all eight in one prefill (whole prompts would go one at a time); in it the target computes
    the prompt's 12 full blocks once, for seven samples to share. Greedy: every sample is the target's output."""
    prompt = torch.randint(3, 250, (200,), generator=torch.Generator().manual_seed(38)).tolist()
    request = _greedy(prompt, 6)
    request.n = 8
    metrics = CoordinatorMetrics()

    async def run() -> tuple[list[list[int]], list[int]]:
        async with in_process_coordinator(llama_workers, metrics, max_prefill_tokens=400) as (address, _):
            tokens: list[list[int]] = [[] for _ in range(8)]
            cached = [-1] * 8
            async with grpc.aio.insecure_channel(address) as channel:
                async for message in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60):
                    tokens[message.index] += message.token_ids
                    if message.finish_reason:
                        cached[message.index] = message.usage.cached_prompt_tokens
            return tokens, cached

    tokens, cached = asyncio.run(run())
    assert sorted(cached) == [0] + [192] * 7  # 12 full blocks of 16 of the 199 tokens before the last
    assert metrics.registry.get_sample_value("minedraft_batch_size_count", {"kind": "prefill"}) == 1
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(llama_workers.pair.target, dtype=torch.float32).eval()
    assert tokens == [hf_reference(target, prompt, 6)] * 8


async def _load(address: str, prompts: list[list[int]]) -> list[str]:
    """Every prompt at once (at random lengths and budgets): a third cancelled after its first message, a third
    with a deadline that may end it anywhere, the rest run to their end."""
    rng = random.Random(17)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        async def one(i: int, prompt: list[int]) -> str:
            await asyncio.sleep(rng.uniform(0.0, 3.0))
            call = stub.Generate(
                _greedy(prompt, rng.randint(1, 24)), timeout=rng.uniform(0.05, 2.0) if i % 3 == 1 else None
            )
            try:
                async for _ in call:
                    if i % 3 == 0:
                        call.cancel()
                        return "cancelled"
            except grpc.aio.AioRpcError as exc:
                return exc.code().name
            return "OK"

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def test_a_thousand_requests_leave_every_block_in_the_pool(
    coordinator: Service, small_pool: Workers, tiny_pairs: TinyPairs
) -> None:
    prompts = text_prompts(tiny_pairs.tokenizer, 1000, 2, 120, seed=21)
    outcomes = asyncio.run(_load(coordinator.address, prompts))
    assert set(outcomes) <= {"OK", "cancelled", "DEADLINE_EXCEEDED", "CANCELLED"}, set(outcomes)
    assert outcomes.count("OK") > 300
    assert_all_slots_free(small_pool, timeout=20)
