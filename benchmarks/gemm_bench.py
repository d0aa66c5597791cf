"""The 8B target's projections at a verify's row counts under cuBLAS and cuBLASLt: us per call and TB/s of the weight.

A verify's GEMMs are most of its time (3.94 of 4.6 ms at B=1), and at few rows cuBLAS splits K and adds a
reduction kernel per call. `torch.backends.cuda.preferred_blas_library` (or TORCH_BLAS_PREFER_CUBLASLT=1) routes
the same `torch.nn.functional.linear` through cuBLASLt, which may choose other kernels. Each figure: 32 calls, each
on its own weight (no cache reuse, as 32 layers), replayed in a CUDA graph.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, ".")
from benchmarks.attention_bench import graph_ms  # noqa: E402

# (name, output features, input features) of the Llama-3-8B shape, fused as engine.fused_projections fuses them
SHAPES = [
    ("qkv", 6144, 4096),
    ("o", 4096, 4096),
    ("gate_up", 28672, 4096),
    ("down", 4096, 14336),
    ("lm_head", 128256, 4096),
]


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ weight.T as `splits` GEMMs over slices of the inputs' features, one batched call with float32 outputs,
    summed: `splits` times the thread blocks of one GEMM whose output tiles alone leave SMs idle (the 8B
    output projection at 80 rows ran 64 blocks on 132 SMs, at 2.2 TB/s)."""
    rows, features = x.shape
    parts = torch.bmm(
        x.view(rows, splits, features // splits).transpose(0, 1),
        weight.view(weight.shape[0], splits, features // splits).permute(1, 2, 0),
        out_dtype=torch.float32,
    )
    return parts.sum(0).to(x.dtype)


def split_m_linear(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x @ weight.T as one batched GEMM over `splits` slices of the rows, every slice reading the same weight (a
    batch stride of 0, no copy): cuBLAS tiles each slice as a GEMM of fewer rows, so the call runs `splits` times the
    thread blocks, the slices' blocks of one weight tile reading it from L2 after the first."""
    rows, features = x.shape
    return torch.bmm(
        x.view(splits, rows // splits, features), weight.t().expand(splits, features, weight.shape[0])
    ).view(rows, weight.shape[0])


def project(x: torch.Tensor, weight: torch.Tensor, splits: int = 1, row_splits: int = 1) -> torch.Tensor:
    """The projection: one GEMM, split over K (`splits`) or over the rows (`row_splits`)."""
    if splits > 1:
        return split_k_linear(x, weight, splits)
    if row_splits > 1:
        return split_m_linear(x, weight, row_splits)
    return torch.nn.functional.linear(x, weight)


def with_residual(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, splits: int, row_splits: int = 1
) -> torch.Tensor:
    """A layer's projection and the residual add after it, as a compiled layer fuses them (the split's sum too)."""
    return residual + project(x, weight, splits, row_splits)


def time_shape(
    out_features: int,
    in_features: int,
    rows: int,
    layers: int,
    repeats: int,
    splits: int | None = None,
    autotune: bool = False,
    row_splits: int = 1,
) -> float:
    """Median us of one call, `layers` calls (each on its own weight) replayed in a CUDA graph `repeats` times: the
    plain linear, or (`splits`) the compiled projection plus residual add (`autotune`: inductor choosing its GEMM
    among cuBLAS and its Triton templates by timing them); either split over the rows (`row_splits`)."""
    weights = [
        torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)
    ]
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
    calls: list[Callable[[], object]]
    if splits is None:
        calls = [functools.partial(project, x, w, 1, row_splits) for w in weights]
    else:
        residual = torch.randn(rows, out_features, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.reset()  # each shape recompiles `with_residual`: past the recompile limit it would run eagerly
        compiled = torch.compile(
            with_residual, fullgraph=True, dynamic=False, mode="max-autotune-no-cudagraphs" if autotune else None
        )
        calls = [functools.partial(compiled, x, w, residual, splits, row_splits) for w in weights]
    us = graph_ms(calls, repeats) * 1e3
    del weights
    torch.cuda.empty_cache()
    return us


def split_k(rows: list[int], splits: list[str], repeats: int, shapes: list[str]) -> None:
    """The projections followed by a residual add (compiled), as one GEMM and split over K, under cuBLASLt ("auto":
    one GEMM, autotuned)."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    print(f"projection + residual add, compiled, cuBLASLt: us per call by splits of K ({', '.join(splits)})")
    for name, n, k in (shape for shape in SHAPES[:-1] if shape[0] in shapes):
        for r in rows:
            cells = [
                f"{time_shape(n, k, r, 32, repeats, 1 if s == 'auto' else int(s), s == 'auto'):8.1f}" for s in splits
            ]
            print(f"{name:>9} {n:>6} {r:>5} " + " ".join(cells), flush=True)


def split_m(rows: list[int], splits: list[int], repeats: int, shapes: list[str]) -> None:
    """The projections as one GEMM and split over the rows, plain and (compiled) followed by the residual add, under
    cuBLASLt; each split's output checked against the plain GEMM's."""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    x, w = (
        torch.randn(80, 4096, device="cuda", dtype=torch.bfloat16),
        torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16),
    )
    diffs = [(split_m_linear(x, w, s) - torch.nn.functional.linear(x, w)).abs().max().item() for s in splits]
    print(
        f"projections under cuBLASLt, us per call by splits of the rows ({', '.join(map(str, splits))}; max diff "
        f"against one GEMM {diffs}): plain | compiled with the residual add"
    )
    for name, n, k in (shape for shape in SHAPES[:-1] if shape[0] in shapes):
        for r in rows:
            ways = [s for s in splits if r % s == 0]
            plain = [f"{time_shape(n, k, r, 32, repeats, row_splits=s):7.1f}" for s in ways]
            fused = [f"{time_shape(n, k, r, 32, repeats, 1, row_splits=s):7.1f}" for s in ways]
            print(f"{name:>9} {n:>6} {r:>5} splits {ways}: " + " ".join(plain) + " | " + " ".join(fused), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="5,40,80", help="rows per call (a verify of k=4: 5 per sequence)")
    parser.add_argument("--backends", default="cublas,cublaslt")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--split-k",
        default="",
        help="e.g. 1,2,4,auto: time the projections (plus the residual add, "
        "compiled) split over K instead (auto: one GEMM, autotuned)",
    )
    parser.add_argument("--split-m", default="", help="e.g. 1,2,4: time the projections split over the rows instead")
    parser.add_argument(
        "--shapes", default=",".join(name for name, *_ in SHAPES[:-1]), help="with --split-k or --split-m"
    )
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.split_m:
        split_m(rows, [int(s) for s in args.split_m.split(",")], args.repeats, args.shapes.split(","))
        return
    if args.split_k:
        split_k(rows, args.split_k.split(","), args.repeats, args.shapes.split(","))
        return
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
        print(
            f"a verify's GEMMs at {r} rows (32 layers + LM head), ms: "
            + ", ".join(f"{b} {totals[(b, r)] / 1e3:.3f}" for b in backends)
        )


if __name__ == "__main__":
    main()
