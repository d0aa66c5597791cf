"""Profile the 8B-shaped verify step and a 68M- or 1B-shaped draft proposal on the GPU: which kernels take the time."""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
from benchmarks.gpu_common import Pair  # noqa: E402
from benchmarks.shaped_checkpoint import build  # noqa: E402
from draft_service.proposer import Proposer  # noqa: E402
from minedraft.engine import cuda_graphs  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402
from minedraft.engine.sequence_table import SequenceTable  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402

# The functions a step's host path passes through before its graphs launch, outermost first
HOST_PATH: list[tuple[type, str]] = [
    (Verifier, "verify"),
    (Proposer, "propose"),
    (SequenceTable, "batch_rows"),
    (SequenceTable, "sampling_kind"),
    (ModelRunner, "prepare"),
    (ModelRunner, "run"),
    (ModelRunner, "_launch"),
    (cuda_graphs.CudaGraphs, "run"),
    (cuda_graphs.CudaGraphs, "_copy_inputs"),
    (torch.cuda.CUDAGraph, "replay"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--compile", action="store_true", help="torch.compile'd decoder layers")
    parser.add_argument("--trace-dir", default=os.environ.get("OUT"), help="write Chrome traces here")
    parser.add_argument("--kernel-tables", default=None, help="write each profiled step's kernels in order here (TSV)")
    parser.add_argument("--batches", default="1,32", help="batch sizes to profile")
    parser.add_argument("--draft", default="68m", choices=["68m", "1b"], help="draft shape")
    parser.add_argument("--one-graph", action="store_true", help="one CUDA graph per step, not a chain")
    parser.add_argument(
        "--chain-growth",
        type=int,
        default=cuda_graphs.CHAIN_GROWTH,
        help="each graph of a step's chain this many times the calls of the one before",
    )
    args = parser.parse_args()
    cuda_graphs.SPLIT_LAUNCH = not args.one_graph
    cuda_graphs.CHAIN_GROWTH = args.chain_growth
    for folder in (args.trace_dir, args.kernel_tables):
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
    device = "cuda:0"
    target, draft = build("8b", device), build(args.draft, device)
    for batch in (int(b) for b in args.batches.split(",")):
        pair = Pair(target, draft, batch, 4, 512, 0.7, 8, compiled=args.compile)
        for _ in range(3):
            pair.propose(0)
            pair.verify(0)
        if pair.verifier.runner.graphs is None or pair.proposer.runner.graphs is None:
            raise RuntimeError("a CUDA graph capture failed (see the log): these steps run eagerly, not measured")
        for name in ("propose", "verify"):
            fn = pair.propose if name == "propose" else pair.verify
            times = []
            for _ in range(5):
                if name == "verify":
                    pair.propose(0)
                pair.settle()
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn(0)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            print(f"B={batch} {name} ms: {[round(x * 1e3, 2) for x in times]}", flush=True)
            if name == "verify":
                pair.propose(0)
            pair.settle()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn(0)
                torch.cuda.synchronize()
            print(
                prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70),
                flush=True,
            )
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy = sum(e.device_time for e in kernels) / 1e3
            print(f"B={batch} {name}: {len(kernels)} kernels, {busy:.2f} ms of kernel time", flush=True)
            gpu_gaps(
                kernels,
                f"B={batch} {name}",
                Path(args.kernel_tables) / f"kernels_{name}_b{batch}.tsv" if args.kernel_tables else None,
            )
            if args.trace_dir:
                prof.export_chrome_trace(str(Path(args.trace_dir) / f"trace_{name}_b{batch}.json"))
        host_phases(pair, batch)
        host_marks(pair, batch)
        host_calls(pair, batch)
        launch_times(pair, batch)
        del pair
        torch.cuda.empty_cache()


def family(name: str) -> str:
    """A kernel's name cut to what says its kind (cuBLAS tiles, Triton function, ATen op)."""
    return name.split("<")[0].split("(")[0][:48]


def gpu_gaps(kernels: list, label: str, table: Path | None) -> None:
    """Where the GPU idles between a step's kernels (from the profiler's kernel records): the step's span on the
    GPU against its kernels' time, the gaps by size, the largest ones with the kernels around them, and the gaps
    summed by the kernel that follows them (which launches wait). `table`: every kernel in order, as TSV."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in kernels)
    if not spans:
        return
    gaps, end_so_far = [], spans[0][1]
    lines = ["start_us\tduration_us\tgap_before_us\tname"]
    for i, (start, end, name) in enumerate(spans):
        gap = max(0.0, start - end_so_far) if i else 0.0
        if i:
            gaps.append((gap, spans[i - 1][2], name))
        lines.append(f"{start - spans[0][0]:.1f}\t{end - start:.1f}\t{gap:.1f}\t{name[:160]}")
        end_so_far = max(end_so_far, end)
    span = (end_so_far - spans[0][0]) / 1e3
    idle = sum(g for g, _, _ in gaps) / 1e3
    bins = [(0, 1), (1, 2), (2, 5), (5, 20), (20, float("inf"))]
    counted = ", ".join(
        f"{lo}-{hi} us: {sum(1 for g, _, _ in gaps if lo <= g < hi)} "
        f"({sum(g for g, _, _ in gaps if lo <= g < hi) / 1e3:.3f} ms)"
        for lo, hi in bins
    )
    print(
        f"{label} on the GPU: span {span:.3f} ms, idle between kernels {idle:.3f} ms over {len(gaps)} gaps ({counted})",
        flush=True,
    )
    for gap, before, after in sorted(gaps, reverse=True)[:8]:
        print(f"  gap {gap:6.1f} us  {family(before)} -> {family(after)}", flush=True)
    by_next: dict[str, list[float]] = {}
    for gap, _, after in gaps:
        by_next.setdefault(family(after), []).append(gap)
    print(f"{label} gaps by the kernel after them (us: total, count, median):", flush=True)
    for kind, values in sorted(by_next.items(), key=lambda item: -sum(item[1]))[:12]:
        print(f"  {sum(values):8.1f} {len(values):4d} {statistics.median(values):5.2f}  {kind}", flush=True)
    if table is not None:
        table.write_text("\n".join(lines) + "\n")


def one_step(pair: Pair, name: str, marks: list) -> tuple[float, float]:
    """A proposal, or a verify of a fresh one, on an idle GPU, `marks` emptied just before its call: (start, end)."""
    if name == "verify":
        pair.propose(0)
    pair.settle()
    torch.cuda.synchronize()
    marks.clear()
    start = time.perf_counter()
    (pair.verify if name == "verify" else pair.propose)(0)
    torch.cuda.synchronize()
    return start, time.perf_counter()


def host_phases(pair: Pair, batch: int, repeats: int = 20) -> None:
    """Where a step's time goes outside its graphs, without the profiler: from the call to the first graph's launch
    (host work before it: the GPU idles), that launch, the launches of the rest of the step's chain (the GPU runs
    meanwhile), and from the last launch's return to the step's return (the GPU finishing, then copying results
    out). Medians over `repeats` steps."""
    replay = torch.cuda.CUDAGraph.replay
    marks: list[float] = []

    def timed_replay(self: torch.cuda.CUDAGraph) -> None:  # named as the method it replaces, for mypy
        marks.append(time.perf_counter())
        replay(self)
        marks.append(time.perf_counter())

    torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign]
    try:
        for name in ("propose", "verify"):
            phases: list[tuple[float, ...]] = []
            for _ in range(repeats):
                start, end = one_step(pair, name, marks)
                if marks:
                    phases.append((marks[0] - start, marks[1] - marks[0], marks[-1] - marks[1], end - marks[-1]))
            if not phases:
                print(f"B={batch} {name}: no graph replayed", flush=True)
                continue
            before, first, rest, after = (sorted(p[i] for p in phases)[len(phases) // 2] * 1e3 for i in range(4))
            print(
                f"B={batch} {name} host phases (median ms): {before:.3f} before the first launch, {first:.3f} "
                f"launching the first graph, {rest:.3f} launching the other {len(marks) // 2 - 1}, {after:.3f} "
                f"from the last launch's return to the step's end",
                flush=True,
            )
    finally:
        torch.cuda.CUDAGraph.replay = replay  # type: ignore[method-assign]


def host_marks(pair: Pair, batch: int, repeats: int = 20) -> None:
    """When a step's host path enters and leaves each of its functions (`HOST_PATH`), in us from the step's call,
    medians over `repeats` steps, without a profiler (each mark costs ~1 us): which part of the host's time before the
    first graph's launch, while the GPU idles, goes where."""
    marks: list[tuple[str, float]] = []

    def marked(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(fn)
        def call(*args: object, **kwargs: object) -> object:
            marks.append((f"{name} enter", time.perf_counter()))
            try:
                return fn(*args, **kwargs)
            finally:
                marks.append((f"{name} leave", time.perf_counter()))

        return call

    originals = [(cls, name, getattr(cls, name)) for cls, name in HOST_PATH]
    for cls, name, fn in originals:
        setattr(cls, name, marked(f"{cls.__name__}.{name}", fn))
    try:
        for step in ("propose", "verify"):
            seen: dict[str, list[float]] = {}
            for _ in range(repeats):
                start, _ = one_step(pair, step, marks)
                first: dict[str, float] = {}
                for mark, at in marks:  # a function called several times (replay): its first entry, last exit
                    if mark.endswith("enter"):
                        first.setdefault(mark, at - start)
                    else:
                        first[mark] = at - start
                for mark, at in first.items():
                    seen.setdefault(mark, []).append(at * 1e6)
            path = sorted((statistics.median(times), mark) for mark, times in seen.items())
            print(
                f"B={batch} {step} host path (us from the call, medians): "
                + "; ".join(f"{mark} {at:.0f}" for at, mark in path),
                flush=True,
            )
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def graphs_captured(runner: ModelRunner) -> int:
    """How many step shapes `runner` has captured a CUDA graph of (0 when it runs eagerly)."""
    return len(runner.graphs.graphs) if runner.graphs is not None else 0


def host_calls(pair: Pair, batch: int, repeats: int = 50, rows: int = 22) -> None:
    """The Python functions and CUDA calls a step spends its host time in (cProfile: each builtin's own time
    includes the CUDA API call it makes), per step, over the `repeats` steps that captured no graph (the rows grow
    into new key-length buckets meanwhile, and a capture's compile and `gc.collect` would swamp the steady state).
    The step's wait for the GPU shows up in the call that reads its result (`tolist`, `synchronize`)."""
    for name in ("propose", "verify"):
        runner = (pair.verifier if name == "verify" else pair.proposer).runner
        kept: list[cProfile.Profile] = []
        for _ in range(repeats):
            if name == "verify":
                pair.propose(0)
            pair.settle()
            torch.cuda.synchronize()
            graphs = graphs_captured(runner)
            profiler = cProfile.Profile()
            profiler.enable()
            (pair.verify if name == "verify" else pair.propose)(0)
            torch.cuda.synchronize()
            profiler.disable()
            if graphs_captured(runner) == graphs:
                kept.append(profiler)
        if not kept:
            print(f"B={batch} {name} host calls: every profiled step captured a graph", flush=True)
            continue
        stats = pstats.Stats(*kept)
        top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:rows]  # type: ignore[attr-defined]
        print(
            f"B={batch} {name} host calls (own time per step, us; calls per step; {len(kept)} of {repeats} steps, "
            "those without a capture):",
            flush=True,
        )
        for (file, line, function), (_, calls, own, _, _) in top:
            where = function if file == "~" else f"{Path(file).name}:{line} {function}"
            print(f"  {own / len(kept) * 1e6:8.1f} {calls / len(kept):5.1f}  {where[:110]}", flush=True)


def launch_times(pair: Pair, batch: int) -> None:
    """Host time of the `replay()`s of each captured step's chain of graphs, without the profiler (CUPTI slows
    launches down): the first launch is what a step pays on the host before the GPU starts, against the chain's GPU
    time. Replays advance the rows of their last inputs: run it on a pair about to be dropped."""
    for role, runner in (("target", pair.verifier.runner), ("draft", pair.proposer.runner)):
        for key, (graphs, _, _) in runner.graphs.graphs.items() if runner.graphs else []:
            first, host, total, gpu = [], [], [], []
            begun, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                begun.record()
                graphs[0].replay()
                first.append(time.perf_counter() - start)
                for graph in graphs[1:]:
                    graph.replay()
                done.record()
                host.append(time.perf_counter() - start)
                torch.cuda.synchronize()
                total.append(time.perf_counter() - start)
                gpu.append(begun.elapsed_time(done) / 1e3)
            print(
                f"B={batch} {role} graphs {key}: {len(graphs)} in its chain, the first launched in "
                f"{sorted(first)[2] * 1e3:.3f} ms on the host, all in {sorted(host)[2] * 1e3:.3f} ms, "
                f"{sorted(total)[2] * 1e3:.2f} ms to finish, {sorted(gpu)[2] * 1e3:.3f} ms on the GPU (events, "
                "no profiler)",
                flush=True,
            )


if __name__ == "__main__":
    main()
