"""The 8B target's projections at a verify's row counts under cuBLAS and cuBLASLt: us per call and TB/s of the weight.

A verify's GEMMs are most of its time (run 17b: 3.94 of 4.6 ms at B=1), and at few rows cuBLAS splits K and adds a
reduction kernel per call. `torch.backends.cuda.preferred_blas_library` (or TORCH_BLAS_PREFER_CUBLASLT=1) routes
the same `torch.nn.functional.linear` through cuBLASLt, which may choose other kernels. Each figure: 32 calls, each
on its own weight (no cache reuse, as 32 layers), replayed in a CUDA graph.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.attention_bench import graph_ms  # noqa: E402

# (name, output features, input features) of the Llama-3-8B shape, fused as minedraft.fused_projections fuses them
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
          ("lm_head", 128256, 4096)]


def time_shape(out_features: int, in_features: int, rows: int, layers: int, repeats: int) -> float:
    """Median us of one call, `layers` calls (each on its own weight) replayed in a CUDA graph `repeats` times."""
    weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02
               for _ in range(layers)]
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    us = graph_ms([functools.partial(torch.nn.functional.linear, x, w) for w in weights], repeats) * 1e3
    del weights
    torch.cuda.empty_cache()
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="5,40,80", help="rows per call (a verify of k=4: 5 per sequence)")
    parser.add_argument("--backends", default="cublas,cublaslt")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    backends = args.backends.split(",")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per call (TB/s of the weight)")
    print(f"{'shape':>16} {'rows':>5} " + " ".join(f"{b:>18}" for b in backends))
    totals = {(b, r): 0.0 for b in backends for r in rows}
    for name, n, k in SHAPES:
        layers = 1 if name == "lm_head" else 32
        for r in rows:
            cells = []
            for backend in backends:
                torch.backends.cuda.preferred_blas_library(backend)
                us = time_shape(n, k, r, layers, args.repeats)
                totals[(backend, r)] += us * (1 if name == "lm_head" else 32)
                cells.append(f"{us:8.1f} ({n * k * 2 / us / 1e6:4.2f})")
            print(f"{name:>9} {n:>6} {r:>5} " + " ".join(f"{c:>18}" for c in cells))
    for r in rows:
        print(f"a verify's GEMMs at {r} rows (32 layers + LM head), ms: "
              + ", ".join(f"{b} {totals[(b, r)] / 1e3:.3f}" for b in backends))


if __name__ == "__main__":
    main()
