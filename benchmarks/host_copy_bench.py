"""Host time of the copies that put a step's inputs into its CUDA graph's buffers, by kind of source.

Before a verify's first graph launch the host spends 0.10-0.20 ms, of it 35-62 us in the copies into
the graph's input buffers (the rows, from host memory, and the drafts, on the device). Each figure: median host
microseconds per call of `buffer[:batch].copy_(source, non_blocking=True)` while the GPU is busy with other work
(as when a verify is sent ahead), for a source in pageable memory, pinned memory and device memory, one input at a
time and all of a step's inputs packed into one buffer; `torch.tensor` of a Python list and a graph's `replay` for
scale.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch


def host_us(fn: Callable[[], object], repeats: int, busy: Callable[[], object]) -> float:
    """Median host microseconds of `fn` with the GPU kept busy by `busy` (launched before each call)."""
    times = []
    for _ in range(repeats):
        busy()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def figures_at(batch: int, k: int, repeats: int, busy: Callable[[], object]) -> list[float]:
    """The table's row at `batch` rows (k drafts each)."""
    device = torch.device("cuda")
    rows_list = list(range(batch))
    pageable = torch.tensor(rows_list, dtype=torch.long)
    pinned = pageable.pin_memory()
    on_device = pageable.to(device)
    drafts = torch.zeros(batch, k, dtype=torch.long, device=device)
    buffer = torch.empty(128, dtype=torch.long, device=device)
    draft_buffer = torch.empty(128, k, dtype=torch.long, device=device)
    packed_host = torch.zeros(batch, 1 + k, dtype=torch.long).pin_memory()
    packed_buffer = torch.empty(128, 1 + k, dtype=torch.long, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buffer.add_(1)

    def two_inputs() -> None:
        buffer[:batch].copy_(pageable, non_blocking=True)
        draft_buffer[:batch].copy_(drafts, non_blocking=True)

    return [
        host_us(lambda: buffer[:batch].copy_(pageable, non_blocking=True), repeats, busy),
        host_us(lambda: buffer[:batch].copy_(pinned, non_blocking=True), repeats, busy),
        host_us(lambda: buffer[:batch].copy_(on_device, non_blocking=True), repeats, busy),
        host_us(two_inputs, repeats, busy),
        host_us(lambda: packed_buffer[:batch].copy_(packed_host, non_blocking=True), repeats, busy),
        host_us(lambda: torch.tensor(rows_list, dtype=torch.long), repeats, busy),
        host_us(graph.replay, repeats, busy),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    big = torch.randn(4096, 4096, device="cuda")
    busy = lambda: big @ big  # noqa: E731  (~0.1 ms of GPU work queued ahead of each call)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call (median of {args.repeats})")
    print(
        f"{'B':>4} {'pageable':>9} {'pinned':>7} {'device':>7} {'2 inputs':>9} {'packed':>7} {'tensor()':>9} "
        f"{'replay':>7}"
    )
    for batch in [int(b) for b in args.batches.split(",")]:
        figures = figures_at(batch, args.k, args.repeats, busy)
        print(f"{batch:>4} " + " ".join(f"{f:>{w}.1f}" for f, w in zip(figures, (9, 7, 7, 9, 7, 9, 7), strict=True)))


if __name__ == "__main__":
    main()
