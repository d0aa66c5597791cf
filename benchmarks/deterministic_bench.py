"""What `--deterministic` costs a step on the GPU: decode, verify and prefill times with and without it.

    python benchmarks/deterministic_bench.py --device cuda:0 --shape 8b --batches 8,64

One model of `--shape` (benchmarks/shaped_checkpoint.py: random bf16 weights) is run by a runner without the flag,
then by one with it (CUDA graphs on in both, layers uncompiled: the flag turns compiling off); each batch's rows hold
`--prefix` tokens first. Prints ms per step and the ratio; the served cost is `gpu_run.sh deterministic-served`.
(`--device cpu --shape 68m` runs it on a CPU, as a check of the script.)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.shaped_checkpoint import VOCAB, build  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def step_times(
    runner: ModelRunner, batch: int, prefix: int, k: int, iters: int, device: str
) -> tuple[float, float, float]:
    """(decode, verify of k + 1 tokens, prefill of `prefix` tokens x min(batch, 8)) in ms, after a warm-up."""
    generator = torch.Generator().manual_seed(0)
    rows_list = runner.allocate(batch)
    rows = torch.tensor(rows_list)

    def ids(n: int, b: int = batch) -> torch.Tensor:
        return torch.randint(0, VOCAB, (b, n), generator=generator)

    prefill_rows = min(batch, 8)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--shape", default="8b", help="8b, 1b, 68m (benchmarks/shaped_checkpoint.py)")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kv-cache-memory", type=float, default=12.0, help="GiB of KV cache per runner")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.device.startswith("cuda"):
        torch.cuda.set_device(args.device)
    model = build(args.shape, args.device)
    results: dict[bool, dict[int, tuple[float, float, float]]] = {}
    for deterministic in (False, True):
        runner = ModelRunner(
            model,
            max(batches),
            args.prefix + 64 + 4 * args.iters * (args.k + 1),
            kv_cache_memory=args.kv_cache_memory,
            deterministic=deterministic,
        )
        with torch.inference_mode():
            results[deterministic] = {
                b: step_times(runner, b, args.prefix, args.k, args.iters, args.device) for b in batches
            }
        del runner
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"{args.shape} on {where}, prefix {args.prefix}, k={args.k} (ms per step)")
    print(f"{'batch':>5} {'step':>8} {'plain':>8} {'determ.':>8} {'ratio':>6}")
    for b in batches:
        for index, name in enumerate(("decode", f"verify{args.k + 1}", "prefill")):
            plain, fixed = results[False][b][index], results[True][b][index]
            print(f"{b:>5} {name:>8} {plain:>8.2f} {fixed:>8.2f} {fixed / plain:>6.2f}")


if __name__ == "__main__":
    main()
