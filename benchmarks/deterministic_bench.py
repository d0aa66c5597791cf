"""What `--deterministic` costs a step on the GPU: decode, verify and prefill times with and without it.

    python benchmarks/deterministic_bench.py --device cuda:0 --shape 8b --batches 8,64

First the matmul's candidate tiles (benchmarks/invariant_matmul_bench.py: rows bit-equal across M, time against
torch.mm at the 8B shapes; `--no-sweep` skips it). Then one model of `--shape` (benchmarks/shaped_checkpoint.py:
random bf16 weights) is run by a runner without the flag, then by one with it in the matmul's default config, and by
one with the sweep's best config where that differs (CUDA graphs on in all, layers uncompiled: the flag turns
compiling off); each batch's rows hold `--prefix` tokens first. Prints ms per step and the ratios; the served cost is
`gpu_run.sh deterministic-served`. (`--device cpu --shape 68m` runs it on a CPU, as a check of the script; the sweep
then runs only under TRITON_INTERPRET=1.)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks import invariant_matmul_bench  # noqa: E402
from benchmarks.shaped_checkpoint import VOCAB, build  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402
from minedraft.kernels.batch_invariant import MatmulConfig  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def step_times(
    runner: ModelRunner, batch: int, prefix: int, k: int, iters: int, device: str
) -> tuple[float, float, float]:
    """(decode, verify of k + 1 tokens, prefill of `prefix` tokens x min(batch, 8)) in ms, after a warm-up (a
    prefill first too: kernels compile at their first use)."""
    generator = torch.Generator().manual_seed(0)

    def ids(n: int, b: int = batch) -> torch.Tensor:
        return torch.randint(0, VOCAB, (b, n), generator=generator)

    prefill_rows = min(batch, 8)
    warm = runner.allocate(prefill_rows)
    runner.forward(torch.tensor(warm), ids(prefix, prefill_rows), torch.full((prefill_rows,), prefix), last_only=True)
    runner.release(warm)
    rows_list = runner.allocate(batch)
    rows = torch.tensor(rows_list)
    sync(device)
    start = time.perf_counter()
    for first in range(0, batch, prefill_rows):
        part = rows[first : first + prefill_rows]
        runner.forward(part, ids(prefix, len(part)), torch.full((len(part),), prefix), last_only=True)
        sync(device)
        if first == 0:
            prefill = (time.perf_counter() - start) * 1e3
    timings = []
    for n in (1, k + 1):
        for _ in range(3):  # graphs captured, kernels compiled
            runner.forward(rows, ids(n), torch.full((batch,), n))
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            runner.forward(rows, ids(n), torch.full((batch,), n))
        sync(device)
        timings.append((time.perf_counter() - start) / iters * 1e3)
    runner.release(rows_list)
    return timings[0], timings[1], prefill


def set_matmul_config(config: MatmulConfig) -> None:
    """The config every deterministic matmul takes from now on (where the Triton kernels run)."""
    from minedraft.kernels import batch_invariant

    batch_invariant.CONFIG = config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shape", default="8b", help="8b, 1b, 68m (benchmarks/shaped_checkpoint.py)")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kv-cache-memory", type=float, default=12.0, help="GiB of KV cache per runner")
    parser.add_argument("--no-sweep", action="store_true", help="skip the matmul configs' sweep")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    best = None if args.no_sweep else invariant_matmul_bench.run(args.device, args.iters)
    sys.stdout.flush()
    default = invariant_matmul_bench.CONFIG
    runs: list[tuple[str, bool, MatmulConfig]] = [("plain", False, default), ("determ.", True, default)]
    if best is not None and best != default:
        runs.append(("best", True, best))
    model = build(args.shape, args.device)
    results: dict[str, dict[int, tuple[float, float, float]]] = {}
    for name, deterministic, config in runs:
        set_matmul_config(config)
        runner = ModelRunner(
            model,
            max(batches),
            args.prefix + 64 + 4 * args.iters * (args.k + 1),
            kv_cache_memory=args.kv_cache_memory,
            deterministic=deterministic,
        )
        with torch.inference_mode():
            results[name] = {b: step_times(runner, b, args.prefix, args.k, args.iters, args.device) for b in batches}
        del runner
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    set_matmul_config(default)
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    names = [name for name, _, _ in runs]
    print(f"{args.shape} on {where}, prefix {args.prefix}, k={args.k} (ms per step; prefill: {args.prefix} tokens x")
    print(f"min(batch, 8) rows; determ.: matmul {default}" + (f", best: {best}" if "best" in names else "") + ")")
    header = f"{'batch':>5} {'step':>8} " + " ".join(f"{n:>8}" for n in names)
    print(header + " " + " ".join(f"{'/plain':>7}" for n in names[1:]))
    for b in batches:
        for index, step in enumerate(("decode", f"verify{args.k + 1}", "prefill")):
            times = [results[n][b][index] for n in names]
            ratios = " ".join(f"{t / times[0]:>7.2f}" for t in times[1:])
            print(f"{b:>5} {step:>8} " + " ".join(f"{t:>8.2f}" for t in times) + " " + ratios)


if __name__ == "__main__":
    main()
