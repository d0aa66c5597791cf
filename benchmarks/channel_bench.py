"""The reverse direction's cost a step: a target's send_back and a draft's receive_back of hidden states, timed.

Two processes (target on the first GPU, draft on the last), as the services run them; each side times its own call
to the end of its GPU work (a synchronize after it), so the figures are what a verify and a proposal each pay, not
the pipe between the processes. Defaults: batch 64, 5 positions, 4,096-wide bf16 (2.6 MB a step).

    python benchmarks/channel_bench.py --channel cuda-ipc
    python benchmarks/channel_bench.py --channel nccl        # two GPUs and CuPy
    python benchmarks/channel_bench.py --channel grpc --device cpu
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue

import torch

from minedraft.channels import make_channel
from minedraft.channels.base import ReverseLayout
from minedraft.proto import common_pb2

K, VOCAB = 4, 1000  # the forward direction's shapes matter not here: ids only


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _draft(
    conn: Connection,
    results: Queue[tuple[str, list[float]]],
    name: str,
    device_name: str,
    layout: ReverseLayout,
    steps: int,
) -> None:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    draft = make_channel(name, device)
    conn.send_bytes(draft.export(K, layout.max_rows, VOCAB, layout))
    draft.attach_back(conn.recv_bytes())
    times = []
    for _ in range(steps):
        payload = common_pb2.TargetPayload.FromString(conn.recv_bytes())
        start = time.perf_counter()
        draft.receive_back(payload)
        _sync(device)
        times.append(time.perf_counter() - start)
        conn.send_bytes(b"ok")
    results.put(("receive_back", times))


def _target(
    conn: Connection,
    results: Queue[tuple[str, list[float]]],
    name: str,
    device_name: str,
    layout: ReverseLayout,
    steps: int,
) -> None:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    target = make_channel(name, device)
    target.attach(conn.recv_bytes())
    conn.send_bytes(target.export_back())
    hidden = {n: torch.randn(layout.max_rows, w, device=device).to(d) for n, w, d in layout.tensors}
    times = []
    for step in range(steps):
        start = time.perf_counter()
        payload = target.send_back(step, hidden)
        _sync(device)
        times.append(time.perf_counter() - start)
        conn.send_bytes(payload.SerializeToString())
        assert conn.recv_bytes() == b"ok"  # (one step at a time, as a verify waits for the proposal before it)
    results.put(("send_back", times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channel", default="cuda-ipc", choices=["local", "grpc", "cuda-ipc", "nccl"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--positions", type=int, default=5, help="rows a sequence sends back (k + 1)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    layout = ReverseLayout(args.batch * args.positions, (("hidden", args.hidden, torch.bfloat16),))
    if args.device == "cuda":
        target_device, draft_device = "cuda:0", f"cuda:{torch.cuda.device_count() - 1}"
    else:
        target_device = draft_device = "cpu"
    context = multiprocessing.get_context("spawn")
    draft_end, target_end = context.Pipe()
    results: Queue[tuple[str, list[float]]] = context.Queue()
    common = (args.channel,)
    children = [
        context.Process(target=_draft, args=(draft_end, results, *common, draft_device, layout, args.steps)),
        context.Process(target=_target, args=(target_end, results, *common, target_device, layout, args.steps)),
    ]
    for child in children:
        child.start()
    timed = dict(results.get(timeout=600) for _ in children)
    for child in children:
        child.join()
    megabytes = layout.max_rows * args.hidden * 2 / 1e6
    report = {"channel": args.channel, "rows": layout.max_rows, "hidden": args.hidden, "megabytes": round(megabytes, 2)}
    report.update({f"{call}_median_us": round(_median_us(times), 1) for call, times in sorted(timed.items())})
    print(json.dumps(report))


def _median_us(times: list[float]) -> float:
    return statistics.median(times[len(times) // 10 :]) * 1e6  # (the first tenth: warm-up)


if __name__ == "__main__":
    main()
