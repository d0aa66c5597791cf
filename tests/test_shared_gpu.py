"""psd with `--overlap auto` on a GPU that target and draft share runs one batch of twice the size, drafted and
verified in turn: the coordinator's choice, the workers' cache layout, and the same tokens as two batches.

A GPU's UUID cannot be had here: the stack test makes the coordinator see one shared GPU by replacing
`coordinator.main.shared_gpus`; everything else (workers, their layout, the steps) is real."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from stack import TinyPairs, Workers, assert_all_slots_free, generate, in_process_coordinator, run_async, text_prompts

import coordinator.main as coordinator_main
from coordinator.batch_manager import BatchManager
from coordinator.main import shared_gpus
from coordinator.request_state import RequestState
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import common_pb2, generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

BATCH = 4


def _info(*gpu_uuids: str, device: str = "cuda:0", listed: bool = True) -> common_pb2.WorkerInfo:
    """A worker's info on `gpu_uuids`; `listed=False`: a worker from before `gpu_uuids`, naming its first only."""
    return common_pb2.WorkerInfo(
        device=device, gpu_uuid=gpu_uuids[0] if gpu_uuids else "", gpu_uuids=gpu_uuids if listed else ()
    )


def test_workers_share_a_gpu_when_their_uuids_match() -> None:
    assert shared_gpus(_info("GPU-a1"), _info("GPU-a1")) == ["GPU-a1"]
    assert not shared_gpus(_info("GPU-a1"), _info("GPU-b2"))  # both cuda:0, in two containers on two GPUs
    assert not shared_gpus(_info(device="cpu"), _info(device="cpu"))
    # A target spread over two GPUs shares its second with a draft there (its first GPU alone would not tell).
    assert shared_gpus(_info("GPU-a1", "GPU-b2", device="cuda:0,cuda:1"), _info("GPU-b2")) == ["GPU-b2"]
    assert not shared_gpus(_info("GPU-a1", "GPU-b2", device="cuda:0,cuda:1"), _info("GPU-c3"))
    assert shared_gpus(_info("GPU-a1", listed=False), _info("GPU-a1")) == ["GPU-a1"]  # an older target


def test_merged_batches_admit_both_batches_room() -> None:
    manager = BatchManager(max_batch_size=BATCH, max_queue_size=20, num_batches=2)
    manager.merge_batches()
    assert len(manager.batches) == 1 and manager.max_batch_size == 2 * BATCH
    for i in range(2 * BATCH + 2):
        manager.submit(RequestState(i, [1, 2, 3], SamplingConfig(), (), None))
    admitted = manager.take_admissions()
    assert [(batch.batch_id, len(requests)) for batch, requests in admitted] == [(0, 2 * BATCH)]
    assert manager.queue_length == 2


def test_psd_on_a_shared_gpu_serves_one_batch_of_twice_the_size(
    llama_workers: Workers, tiny_pairs: TinyPairs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The same greedy tokens as psd's two batches, and back."""
    workers = llama_workers
    assert workers.draft is not None
    params = generation_pb2.SamplingParams(max_tokens=24, ignore_eos=True)
    requests = [
        generation_pb2.GenerateRequest(prompt_token_ids=p, params=params)
        for p in text_prompts(tiny_pairs.tokenizer, 2 * BATCH, 6, 20, seed=31)
    ]

    async def serve_all(shared: bool) -> tuple[generation_pb2.GetServerInfoResponse, list[list[int]], int]:
        monkeypatch.setattr(coordinator_main, "shared_gpus", lambda target, draft: ["GPU-test"] if shared else [])
        async with in_process_coordinator(workers, max_batch_size=BATCH) as (address, coordinator):
            async with grpc.aio.insecure_channel(address) as channel:
                info = await generation_pb2_grpc.GenerationServiceStub(channel).GetServerInfo(
                    generation_pb2.GetServerInfoRequest()
                )
            completions = await asyncio.gather(*(generate(address, r) for r in requests))
            assert all(c.usage.draft_tokens > 0 for c in completions)  # drafted, not decoded alone
            return info, [c.token_ids for c in completions], len(coordinator.manager.batches)

    caplog.set_level(logging.INFO, logger="coordinator")
    two_info, two, two_batches = run_async(serve_all(False))  # type: ignore[misc]
    one_info, one, one_batches = run_async(serve_all(True))  # type: ignore[misc]
    again_info, again, _ = run_async(serve_all(False))  # type: ignore[misc]
    assert (two_info.mode, two_info.max_batch_size, two_batches) == ("psd", BATCH, 2)
    assert (one_info.mode, one_info.max_batch_size, one_batches) == ("sd", 2 * BATCH, 1)
    assert again_info.mode == "psd"
    assert one == two == again
    assert "one batch of up to 8 sequences" in caplog.text
    assert_all_slots_free(workers)
