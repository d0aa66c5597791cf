"""Channels: byte-exact round trips both ways (draft -> target, target -> draft) with a step's shapes and dtypes, again
after a draft restart; the reverse layout's bounds; the nccl channel's code path over gloo between two processes,
beside a default process group (as a tensor-parallel worker holds), and between real worker processes; a
rendezvous that cannot complete fails within its bound."""

from __future__ import annotations

import importlib.util
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from stack import TinyPairs, Workers, generate_all, mixed_requests, run_async, running_coordinator

from minedraft.channels import Channel, make_channel
from minedraft.channels.base import ReverseLayout
from minedraft.errors import ChannelSetupError, ModelLoadError
from minedraft.proto import common_pb2

pytest_plugins = ["stack"]

# A step's shapes, small: B sequences, k drafts, a vocabulary of V; hidden states [rows, H] back (rows: up to k + 1
# positions a sequence).
B, K, V, H = 3, 4, 100, 64
LAYOUT = ReverseLayout(
    max_rows=B * (K + 1),
    tensors=(("hidden", H, torch.bfloat16), ("positions", 1, torch.int32), ("slots", 2, torch.int64)),
)
CPU = torch.device("cpu")


def _step(step: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Step `step`'s tensors, the same in every process: ids int64 [B, k], fp32 probabilities [B, k, V] and, back,
    bf16 hidden states, int32 and int64 columns (their whole ranges) of a row count that differs between steps."""
    gen = torch.Generator().manual_seed(step)
    rows = B * (K + 1) - step
    back = {
        "hidden": torch.randn(rows, H, generator=gen).to(torch.bfloat16),
        "positions": torch.randint(-(2**31), 2**31 - 1, (rows, 1), generator=gen, dtype=torch.int32),
        "slots": torch.randint(-(2**62), 2**62, (rows, 2), generator=gen),
    }
    return torch.randint(0, V, (B, K), generator=gen), torch.rand(B, K, V, generator=gen), back


def _assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], device: torch.device = CPU) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert got[name].device == device and got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].cpu(), tensor), name


def _draft_steps(draft: Channel, send: Callable[[bytes], None], receive: Callable[[], bytes]) -> None:
    """The draft's side of three steps (on its device): proposes (with probabilities but at the middle step), reads
    the target's tensors. Also the GPU tests' (tests/test_gpu_channels.py)."""
    for step in range(3):
        ids, probs, back = _step(step)
        device = draft.device
        send(draft.send(step, ids.to(device), None if step == 1 else probs.to(device)).SerializeToString())
        _assert_exact(draft.receive_back(common_pb2.TargetPayload.FromString(receive())), back, device)


def _target_steps(target: Channel, send: Callable[[bytes], None], receive: Callable[[], bytes]) -> None:
    """The target's side of three steps (on its device): reads the drafts, sends its tensors back."""
    for step in range(3):
        ids, probs, back = _step(step)
        got_ids, got_probs = target.receive(common_pb2.DraftPayload.FromString(receive()))
        assert got_ids.device == target.device and got_ids.dtype == torch.long and torch.equal(got_ids.cpu(), ids)
        assert got_probs is None if step == 1 else got_probs is not None and torch.equal(got_probs.cpu(), probs)
        send(target.send_back(step, {name: t.to(target.device) for name, t in back.items()}).SerializeToString())


@pytest.mark.parametrize("name", ["local", "grpc"])
def test_channel_carries_a_steps_tensors_both_ways_again_after_a_draft_restart(name: str) -> None:
    for _ in range(2):  # the second: a draft restarted, and a fresh channel set up on both sides
        draft, target = make_channel(name, CPU), make_channel(name, CPU)
        target.attach(draft.export(K, B, V, LAYOUT))
        draft.attach_back(target.export_back())
        for step in range(3):  # (one process: each side's step in turn, the payloads serialized between them)
            ids, probs, back = _step(step)
            payload = draft.send(step, ids, None if step == 1 else probs).SerializeToString()
            got_ids, got_probs = target.receive(common_pb2.DraftPayload.FromString(payload))
            assert got_ids.dtype == torch.long and torch.equal(got_ids, ids)
            assert got_probs is None if step == 1 else got_probs is not None and torch.equal(got_probs, probs)
            back_payload = target.send_back(step, back).SerializeToString()
            _assert_exact(draft.receive_back(common_pb2.TargetPayload.FromString(back_payload)), back)
        draft.close()
        target.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grpc_channel_round_trip_is_exact(dtype: torch.dtype) -> None:
    channel = make_channel("grpc", CPU)
    ids = torch.randint(0, 1000, (3, 4))
    probs = torch.rand(3, 4, 1000).to(dtype)
    payload = common_pb2.DraftPayload.FromString(channel.send(7, ids, probs).SerializeToString())
    got_ids, got_probs = channel.receive(payload)
    assert torch.equal(got_ids, ids) and got_probs is not None
    assert got_probs.dtype == dtype and torch.equal(got_probs, probs)
    assert channel.receive(channel.send(8, ids, None))[1] is None


@pytest.mark.parametrize("name", ["local", "grpc", "nccl"])
def test_send_back_refuses_what_the_layout_does_not_allow(name: str) -> None:
    draft, target = make_channel(name, CPU), make_channel(name, CPU)
    target.attach(draft.export(K, B, V, LAYOUT))
    draft.attach_back(target.export_back())
    rows = LAYOUT.max_rows + 1
    with pytest.raises(ValueError, match=rf"{rows} rows exceed the {LAYOUT.max_rows} set up.*split"):
        target.send_back(0, {"hidden": torch.zeros(rows, H, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match="'logits' is not in the reverse layout"):
        target.send_back(0, {"logits": torch.zeros(1, H)})
    with pytest.raises(ValueError, match=r"'hidden' is \(2, 64\) torch.float32, the layout says \[rows, 64\]"):
        target.send_back(0, {"hidden": torch.zeros(2, H)})
    with pytest.raises(ValueError, match="one row count"):
        target.send_back(0, {"hidden": torch.zeros(2, H, dtype=torch.bfloat16), "positions": torch.zeros(3, 1)})
    bare_draft, bare_target = make_channel(name, CPU), make_channel(name, CPU)
    bare_target.attach(bare_draft.export(K, B, V))
    with pytest.raises(ValueError, match="no reverse layout was set up"):
        bare_target.send_back(0, {"hidden": torch.zeros(2, H, dtype=torch.bfloat16)})
    for channel in (draft, target, bare_draft, bare_target):
        channel.close()


def test_local_channel_hands_tensors_over() -> None:
    draft_side, target_side = make_channel("local", CPU), make_channel("local", CPU)
    target_side.attach(draft_side.export(4, 8, 100))
    ids, probs = torch.randint(0, 100, (2, 4)), torch.rand(2, 4, 100)
    got_ids, got_probs = target_side.receive(draft_side.send(3, ids, probs))
    assert torch.equal(got_ids, ids) and got_probs is not None and torch.equal(got_probs, probs)
    draft_side.close()


def test_unknown_channel_is_named() -> None:
    with pytest.raises(ValueError, match="unknown channel 'carrier-pigeon'"):
        make_channel("carrier-pigeon", CPU)


def _nccl_draft_process(conn: Connection) -> None:
    """A draft worker's side of the nccl channel, set up twice (the second: after a restart), over gloo."""
    for _ in range(2):
        draft = make_channel("nccl", CPU)
        conn.send_bytes(draft.export(K, B, V, LAYOUT))
        draft.attach_back(conn.recv_bytes())
        _draft_steps(draft, conn.send_bytes, conn.recv_bytes)
        conn.send_bytes(b"done")  # (the target's last send is asynchronous: it closes once this side has it)
        draft.close()


def _nccl_target_process(conn: Connection, store_path: str) -> None:
    """A tensor-parallel target's rank 0 (torch's default group taken) and its side of the nccl channel, set up
    afresh for each of the draft's two lives."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    for _ in range(2):
        target = make_channel("nccl", CPU)
        target.attach(conn.recv_bytes())
        conn.send_bytes(target.export_back())
        _target_steps(target, conn.send_bytes, conn.recv_bytes)
        assert conn.recv_bytes() == b"done"
        target.close()
    one = torch.ones(1)
    dist.all_reduce(one)  # the default group is untouched and still works
    assert dist.get_world_size() == 1 and one.item() == 1
    dist.destroy_process_group()


def test_nccl_channel_over_gloo_carries_both_ways_between_processes_beside_a_default_group(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    draft_end, target_end = context.Pipe()
    children = [
        context.Process(target=_nccl_draft_process, args=(draft_end,)),
        context.Process(target=_nccl_target_process, args=(target_end, str(tmp_path / "store"))),
    ]
    for child in children:
        child.start()
    draft_end.close()  # (the children's now: one that dies ends the other's wait on the pipe)
    target_end.close()
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0]


def test_nccl_rendezvous_with_a_wrong_host_fails_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft that advertises an address the target cannot reach (TEST-NET-1: routed nowhere): the target's attach
    fails naming it, within the set-up's bound, rather than hang."""
    monkeypatch.setenv("MINEDRAFT_ADVERTISE_HOST", "192.0.2.1")
    draft, target = make_channel("nccl", CPU), make_channel("nccl", CPU)
    draft.setup_timeout_s = target.setup_timeout_s = 1.0
    handshake = draft.export(K, B, V)
    start = time.monotonic()
    with pytest.raises(ChannelSetupError, match=r"nccl channel rendezvous with 192\.0\.2\.1:\d+ failed"):
        target.attach(handshake)
    assert time.monotonic() - start < 5.0


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

    from stack import server_port

    from minedraft_app.stack import wait_healthy

    requests = mixed_requests(tiny_pairs.tokenizer)
    with running_coordinator(llama_workers, stack_logs, "psd") as coordinator:
        expected = run_async(generate_all(coordinator.address, requests))
    pair, port = llama_workers.pair, server_port()
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
