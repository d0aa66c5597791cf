"""Capacity waits, never fails: a prefill a worker has no room for is tried again later, or the target decodes alone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
import torch
from stack import (
    Completion,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate,
    in_process_coordinator,
    run_async,
    text_prompts,
)

from coordinator import workers as coordinator_workers
from coordinator.main import Coordinator
from coordinator.request_state import RequestState
from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

# What a worker's CapacityError reaches the coordinator as (minedraft.rpc.server_utils maps it).
NO_ROOM = "the KV cache is out of blocks: this step needs 9 more, 3 are free of 15 (forced by the test)"


def _no_room() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, details=NO_ROOM)


def _requests(tiny_pairs: TinyPairs, count: int, max_tokens: int, seed: int) -> list[generation_pb2.GenerateRequest]:
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = text_prompts(tiny_pairs.tokenizer, count, 6, 30, seed=seed)
    return [generation_pb2.GenerateRequest(prompt_token_ids=p, params=params) for p in prompts]


def _expected(
    workers: Workers, requests: Sequence[generation_pb2.GenerateRequest], hf_reference: Any
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(workers.pair.target, dtype=torch.float32).eval()
    return [hf_reference(target, list(r.prompt_token_ids), r.params.max_tokens) for r in requests]


async def _when_decoding(coordinator: Coordinator, count: int) -> None:
    """Until `count` admitted requests have emitted a token (they run: their sequences hold the workers' blocks)."""
    for _ in range(600):
        if sum(1 for r in coordinator.manager.running() if r.output_ids) >= count:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the first requests never started decoding")


async def _samples(address: str, request: generation_pb2.GenerateRequest) -> list[list[int]]:
    """The token ids of each of the request's samples (GenerateRequest.n)."""
    async with grpc.aio.insecure_channel(address) as channel:
        tokens: list[list[int]] = [[] for _ in range(request.n)]
        async for message in generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120):
            tokens[message.index] += message.token_ids
        return tokens


def test_a_target_prefill_without_room_waits_and_completes_losslessly(
    llama_workers: Workers,
    tiny_pairs: TinyPairs,
    hf_reference: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Forced: admission counts both workers' KV blocks as upper bounds of what calls take, so real workers never
    refuse an admitted prefill (an estimate could still be wrong, and then a worker's CapacityError comes back as
    RESOURCE_EXHAUSTED). The target's Prefill is refused twice, as a worker out of blocks refuses it: the first
    admission (a request's two samples, queued together, nothing running), then one made while those decode. Each
    group goes back to the queue, is freed on the draft (which took it), and is prefilled again: every request
    completes as HF generate() has it, and no row or block stays held."""
    first = _requests(tiny_pairs, 1, 40, seed=31)[0]
    first.n = 2  # (greedy: both samples are the target's one output)
    later = _requests(tiny_pairs, 4, 12, seed=32)
    expected = _expected(llama_workers, [first, first, *later], hf_reference)
    refused: list[tuple[int, int]] = []  # (group size, sequences running besides it) of each refusal
    coordinator: Coordinator | None = None
    prefill_target = coordinator_workers.Workers.prefill_target

    async def refused_twice(self: coordinator_workers.Workers, requests: Sequence[RequestState]) -> Any:
        assert coordinator is not None
        others = coordinator.manager.num_running - len(requests)
        if (not refused and not others and len(requests) > 1) or (len(refused) == 1 and others >= 2):
            refused.append((len(requests), others))
            raise _no_room()
        return await prefill_target(self, requests)

    monkeypatch.setattr(coordinator_workers.Workers, "prefill_target", refused_twice)

    async def run() -> list[list[int]]:
        nonlocal coordinator
        async with in_process_coordinator(llama_workers, speculation="always") as (address, coordinator):
            samples = asyncio.ensure_future(_samples(address, first))
            await _when_decoding(coordinator, 2)
            done = await asyncio.gather(*(generate(address, r) for r in later))
            return [*await samples, *(c.token_ids for c in done)]

    caplog.set_level(logging.INFO, logger="coordinator")
    outputs = run_async(run())
    assert outputs == expected
    assert refused[0] == (2, 0) and refused[1][1] == 2, refused
    assert "no room on the target for a prefill of 2 requests" in caplog.text
    assert "they wait for admission one at a time" in caplog.text
    assert "they wait for one of the 2 running sequences to end" in caplog.text
    assert "failing" not in caplog.text and "step failed" not in caplog.text, caplog.text
    assert_all_slots_free(llama_workers)


def test_a_request_without_room_on_an_idle_target_fails_with_resource_exhausted(
    llama_workers: Workers, tiny_pairs: TinyPairs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forced, as above: with nothing else running no memory will free, so a lone request the target refuses fails
    at once with a status and a message a person can act on; the next request is served."""
    refused, served = _requests(tiny_pairs, 2, 6, seed=33)
    prefill_target = coordinator_workers.Workers.prefill_target

    async def refusing(self: coordinator_workers.Workers, requests: Sequence[RequestState]) -> Any:
        if any(r.prompt_ids == list(refused.prompt_token_ids) for r in requests):
            raise _no_room()
        return await prefill_target(self, requests)

    monkeypatch.setattr(coordinator_workers.Workers, "prefill_target", refusing)

    async def run() -> tuple[grpc.aio.AioRpcError, Completion]:
        async with in_process_coordinator(llama_workers) as (address, _):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await generate(address, refused)
            return caught.value, await generate(address, served)

    error, completion = run_async(run())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "cannot hold this request even with nothing else running" in (error.details() or "")
    assert "--kv-cache-memory" in (error.details() or "")
    assert len(completion.token_ids) == 6
    assert_all_slots_free(llama_workers)


def test_a_draft_prefill_without_room_leaves_the_draft_until_it_has_room(
    llama_workers: Workers,
    tiny_pairs: TinyPairs,
    hf_reference: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Forced, as above (the draft's blocks are counted as the target's are). The draft refuses one admission's
    Prefill, which the target took: the target decodes those requests alone, nothing fails, the outputs are HF
    generate()'s, one WARNING says why; the draft is probed, handed the running requests, and drafts again."""
    first, later = _requests(tiny_pairs, 2, 40, seed=34), _requests(tiny_pairs, 4, 30, seed=35)
    expected = _expected(llama_workers, first + later, hf_reference)
    refused: list[int] = []
    coordinator: Coordinator | None = None
    prefill_draft = coordinator_workers.Workers.prefill_draft

    async def refused_once(
        self: coordinator_workers.Workers, requests: Sequence[RequestState], resume: bool = False
    ) -> None:
        assert coordinator is not None
        if not refused and not resume and coordinator.manager.num_running > len(requests):
            refused.append(len(requests))
            raise _no_room()
        await prefill_draft(self, requests, resume)

    monkeypatch.setattr(coordinator_workers.Workers, "prefill_draft", refused_once)

    async def run() -> tuple[list[Completion], bool]:
        nonlocal coordinator
        async with in_process_coordinator(llama_workers, speculation="always", draft_retry_interval=0.5) as (
            address,
            coordinator,
        ):
            started = [asyncio.ensure_future(generate(address, r)) for r in first]
            await _when_decoding(coordinator, 2)
            done = await asyncio.gather(*(generate(address, r) for r in later))
            done = [*await asyncio.gather(*started), *done]
            for _ in range(600):  # taken back during steps: a short request or two gives it the chance
                if coordinator.workers.failover.draft_connected:
                    break
                await generate(address, later[0])
            return done, coordinator.workers.failover.draft_connected

    caplog.set_level(logging.INFO, logger="coordinator")
    done, drafting_again = run_async(run())
    assert refused, "the draft was never asked for a prefill while others ran"
    assert [c.token_ids for c in done] == expected
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "has no room" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "continuing with the target alone" in warnings[0].getMessage()
    assert "failing" not in caplog.text and "step failed" not in caplog.text, caplog.text
    assert drafting_again and "draft service back" in caplog.text
    assert_all_slots_free(llama_workers)
