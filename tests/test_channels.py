"""Channels: byte-exact round trips, and the nccl channel's code path over gloo: beside a default process group (as
a tensor-parallel worker holds), and between real worker processes."""

from __future__ import annotations

import importlib.util
import multiprocessing
from pathlib import Path

import pytest
import torch
from stack import TinyPairs, Workers, generate_all, mixed_requests, run_async, running_coordinator

from minedraft.channels import make_channel
from minedraft.errors import ModelLoadError
from minedraft.proto import common_pb2

pytest_plugins = ["stack"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grpc_channel_round_trip_is_exact(dtype: torch.dtype) -> None:
    channel = make_channel("grpc", torch.device("cpu"))
    ids = torch.randint(0, 1000, (3, 4))
    probs = torch.rand(3, 4, 1000).to(dtype)
    payload = common_pb2.DraftPayload.FromString(channel.send(7, ids, probs).SerializeToString())
    got_ids, got_probs = channel.receive(payload)
    assert torch.equal(got_ids, ids) and got_probs is not None
    assert got_probs.dtype == dtype and torch.equal(got_probs, probs)
    assert channel.receive(channel.send(8, ids, None))[1] is None


def test_local_channel_hands_tensors_over() -> None:
    draft_side, target_side = make_channel("local", torch.device("cpu")), make_channel("local", torch.device("cpu"))
    target_side.attach(draft_side.export(4, 8, 100))
    ids, probs = torch.randint(0, 100, (2, 4)), torch.rand(2, 4, 100)
    got_ids, got_probs = target_side.receive(draft_side.send(3, ids, probs))
    assert torch.equal(got_ids, ids) and got_probs is not None and torch.equal(got_probs, probs)
    draft_side.close()


def test_unknown_channel_is_named() -> None:
    with pytest.raises(ValueError, match="unknown channel 'carrier-pigeon'"):
        make_channel("carrier-pigeon", torch.device("cpu"))


def _nccl_pair_beside_a_default_group(store_path: str) -> None:
    """In a process whose default group is taken: two nccl channels, one after the other (a fresh one after the
    first is closed, as after a worker's restart), carry a step's ids and fp32 probabilities exactly."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    cpu = torch.device("cpu")
    for _ in range(2):
        draft, target = make_channel("nccl", cpu), make_channel("nccl", cpu)
        target.attach(draft.export(4, 8, 100))
        for step, batch in enumerate((3, 8, 1)):
            ids, probs = torch.randint(0, 100, (batch, 4)), torch.rand(batch, 4, 100)
            payload = common_pb2.DraftPayload.FromString(draft.send(step, ids, probs).SerializeToString())
            got_ids, got_probs = target.receive(payload)
            assert torch.equal(got_ids, ids) and got_probs is not None and torch.equal(got_probs, probs)
        got_ids, got_probs = target.receive(draft.send(3, ids, None))
        assert torch.equal(got_ids, ids) and got_probs is None
        draft.close()
        target.close()
    one = torch.ones(1)
    dist.all_reduce(one)  # the default group is untouched and still works
    assert dist.get_world_size() == 1 and one.item() == 1
    dist.destroy_process_group()


def test_nccl_channel_over_gloo_beside_a_default_group(tmp_path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(
        target=_nccl_pair_beside_a_default_group, args=(str(tmp_path / "store"),)
    )
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0


def test_nccl_channel_without_cupy_on_a_gpu_names_the_package() -> None:
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    with pytest.raises(ModelLoadError, match=r"pip install 'minedraft\[gpu\]'"):
        make_channel("nccl", torch.device("cuda")).export(4, 8, 100)


def test_nccl_channel_over_gloo_gives_the_grpc_channels_output(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path
) -> None:
    """Same seeds, same drafts, same verdicts: a channel only moves tensors, so outputs must be identical."""
    requests = mixed_requests(tiny_pairs.tokenizer)
    outputs = {}
    for channel in ("grpc", "nccl"):
        with running_coordinator(llama_workers, stack_logs, "psd", extra=["--channel", channel]) as coordinator:
            outputs[channel] = run_async(generate_all(coordinator.address, requests))
    assert all(len(tokens) == 24 for tokens in outputs["nccl"])
    assert outputs["nccl"] == outputs["grpc"]


def test_seeded_sampling_does_not_depend_on_mode_or_batch_mates(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path
) -> None:
    """Randomness is keyed by (seed, position, purpose): psd and sd, with different batch mates, agree exactly."""
    requests = mixed_requests(tiny_pairs.tokenizer)
    outputs = {}
    for mode in ("psd", "sd"):
        with running_coordinator(llama_workers, stack_logs, mode) as coordinator:
            outputs[mode] = run_async(generate_all(coordinator.address, requests))
            alone = run_async(generate_all(coordinator.address, requests[1:2]))  # a sampled request on its own
            assert alone[0] == outputs[mode][1]
    assert outputs["psd"] == outputs["sd"]


def test_single_process_serve_over_the_local_channel_matches_the_services(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path
) -> None:
    """`serve --single-process` (both models in one process, drafts handed over by `local`) is the same system."""
    import os
    import signal
    import subprocess
    import sys

    from minedraft_app.stack import free_port, wait_healthy

    requests = mixed_requests(tiny_pairs.tokenizer)
    with running_coordinator(llama_workers, stack_logs, "psd") as coordinator:
        expected = run_async(generate_all(coordinator.address, requests))
    pair, port = llama_workers.pair, free_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minedraft_app",
            "serve",
            "--single-process",
            "--target",
            str(pair.target),
            "--draft",
            str(pair.draft),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--dtype",
            "float32",
            "--max-batch-size",
            "4",
            "--max-model-len",
            "256",
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1", "MINEDRAFT_HTTP_PORT": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(f"127.0.0.1:{port}", [serve], timeout=180)
        assert run_async(generate_all(f"127.0.0.1:{port}", requests)) == expected
    finally:
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=60) == 0
