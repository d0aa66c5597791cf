"""Time a step's projections on the GPU: cuBLAS (`torch.nn.functional.linear`) against the few-row Triton kernel
(`minedraft.skinny_linear`), at the 8B target's and 1B draft's weight shapes and a step's row counts.

Each figure is the median time per call of 32 calls replayed in a CUDA graph, each on its own weight (32 layers' worth:
one weight would sit in the L2 cache), with the bandwidth it reached reading the weight. `--sweep` times the kernel's
parameters (`skinny_linear.BLOCK_N`, `BLOCK_K`, `NUM_STAGES`, `NUM_WARPS`) instead. Choose by whole steps
(`benchmarks/gpu_run.sh ab compile` with `skinny_linear.ENABLED` flipped), as for the attention: a projection alone
does not predict a step.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable

import torch
from attention_bench import graph_ms

from minedraft import skinny_linear

# name -> (output columns, K): the fused projections of an 8B (Llama-3) layer and of a 1B one.
SHAPES = {
    "8b-qkv": (6144, 4096), "8b-o": (4096, 4096), "8b-gate-up": (28672, 4096), "8b-down": (4096, 14336),
    "1b-qkv": (3072, 2048), "1b-o": (2048, 2048), "1b-gate-up": (16384, 2048), "1b-down": (2048, 8192),
}
LAYERS = 32


def calls(shape: tuple[int, int], rows: int, kernel: bool) -> tuple[list[Callable[[], object]], float]:
    """The calls of one path on LAYERS weights of `shape`, and the bytes each reads."""
    n_out, k_in = shape
    weights = [torch.randn(n_out, k_in, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    x = torch.randn(rows, k_in, dtype=torch.bfloat16, device="cuda")
    fn = skinny_linear.skinny_linear if kernel else torch.nn.functional.linear
    return [functools.partial(fn, x, w) for w in weights], (n_out * k_in + rows * (k_in + n_out)) * 2


def check(shape: tuple[int, int], rows: int) -> float:
    """The kernel's relative error against cuBLAS in float32 (bf16 inputs)."""
    n_out, k_in = shape
    x = torch.randn(rows, k_in, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(n_out, k_in, dtype=torch.bfloat16, device="cuda")
    expected = torch.nn.functional.linear(x.float(), w.float())
    return ((skinny_linear.skinny_linear(x, w).float() - expected).norm() / expected.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,5,16,40,80", help="rows per call: tokens of a step (batch x (k + 1))")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="time the kernel's parameters instead of the two paths")
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    shapes = args.shapes.split(",")
    if args.sweep:
        print("shape rows block_n block_k stages warps us TB/s", flush=True)
        for name, rows in itertools.product(shapes, rows_list):
            best: tuple[float, tuple[int, ...]] | None = None
            for config in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6), (4, 8)):
                skinny_linear.BLOCK_N, skinny_linear.BLOCK_K, skinny_linear.NUM_STAGES, skinny_linear.NUM_WARPS = config
                if SHAPES[name][1] % config[1]:
                    continue
                try:
                    fns, size = calls(SHAPES[name], rows, True)
                    us = graph_ms(fns) * 1e3
                except Exception as exc:  # a tile too large for shared memory: skipped  # noqa: BLE001
                    print(f"{name} {rows} {config}: {type(exc).__name__}", flush=True)
                    continue
                print(f"{name} {rows} {' '.join(map(str, config))} {us:.1f} {size / us / 1e6:.2f}", flush=True)
                best = min(best or (us, config), (us, config))
            skinny_linear.BLOCK_N = skinny_linear.BLOCK_K = skinny_linear.NUM_STAGES = skinny_linear.NUM_WARPS = None
            print(f"best {name} rows={rows}: {best}", flush=True)
        return
    print(f"{'shape':>11} {'rows':>4} {'cuBLAS us':>9} {'TB/s':>5} {'kernel us':>9} {'TB/s':>5} {'kernel/cuBLAS':>13} "
          f"{'rel. error':>10}", flush=True)
    for name, rows in itertools.product(shapes, rows_list):
        cublas_fns, size = calls(SHAPES[name], rows, False)
        kernel_fns, _ = calls(SHAPES[name], rows, True)
        cublas, kernel = graph_ms(cublas_fns) * 1e3, graph_ms(kernel_fns) * 1e3
        print(f"{name:>11} {rows:>4} {cublas:>9.1f} {size / cublas / 1e6:>5.2f} {kernel:>9.1f} "
              f"{size / kernel / 1e6:>5.2f} {kernel / cublas:>13.2f} {check(SHAPES[name], rows):>10.1e}", flush=True)
        del cublas_fns, kernel_fns
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
