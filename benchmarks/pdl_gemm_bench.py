"""A verify's projections as Triton GEMMs chained by programmatic dependent launch (PDL), against cuBLASLt.

In a CUDA graph each of a layer's four GEMMs costs ~6.6 us beyond its weight's bytes at 4.6 TB/s (a measured table
fits t = 6.6 us + bytes / 4.64 TB/s from 5 to 80 rows): 0.84 ms of an 8B verify, more than its gap to 1.3x the
floor. Part of it is each kernel's start (launch, the first weight bytes' latency) after the previous one's last
block. With PDL (Hopper), a kernel is launched while the one before runs; its blocks read their first weight tile,
which no earlier kernel writes, then wait for the previous grid (`griddepcontrol.wait`) before reading activations.
Each figure: us per call, 32 calls (each its own weight) replayed in a CUDA graph; the Triton outputs are checked
against cuBLAS.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from benchmarks.attention_bench import graph_ms  # noqa: E402
from benchmarks.gemm_bench import SHAPES  # noqa: E402


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows,
    features,
    stride_x,
    stride_w,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program: BLOCK_N output features of every row, over all input features (weights [N, K], rows [M, K])."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    live = m < rows
    w_tile = w_ptr + n[:, None] * stride_w + k[None, :]
    x_tile = x_ptr + m[:, None] * stride_x + k[None, :]
    w = tl.load(w_tile)  # no earlier kernel writes the weight: read before waiting on them
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.dot(tl.load(x_tile, mask=live[:, None], other=0.0), tl.trans(w))
    for start in range(BLOCK_K, features, BLOCK_K):
        x = tl.load(x_tile + start, mask=live[:, None], other=0.0)
        acc += tl.dot(x, tl.trans(tl.load(w_tile + start)))
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=live[:, None])


def triton_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int, pdl: bool, block_k: int = 128) -> torch.Tensor:
    """x @ weight.T for at most 128 rows, `block_n` output features a program."""
    rows, features = x.shape
    stages = 4 if rows <= 64 else 3  # four stages of 128-row tiles exceed an H200's shared memory
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    assert weight.shape[0] % block_n == 0 and features % block_k == 0 and rows <= 128
    _linear_kernel[(weight.shape[0] // block_n,)](
        x,
        weight,
        out,
        rows,
        features,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=pdl,
        num_warps=4,
        num_stages=stages,
        launch_pdl=pdl,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="5,40,80")
    parser.add_argument("--block-n", default="32,64")
    parser.add_argument("--shapes", default="o,qkv,down,gate_up")
    args = parser.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    blocks = [int(b) for b in args.block_n.split(",")]
    columns = ["cuBLASLt"] + [f"N{b}{' PDL' if pdl else ''}" for b in blocks for pdl in (False, True)]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}; us per call, "
        "32 calls in a CUDA graph"
    )
    print(f"{'shape':>9} {'rows':>5} " + " ".join(f"{c:>10}" for c in columns))
    for name, n, k in (shape for shape in SHAPES if shape[0] in args.shapes.split(",")):
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(32)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            plain: list[Callable[[], object]] = [functools.partial(torch.nn.functional.linear, x, w) for w in weights]
            cells = [graph_ms(plain) * 1e3]
            for block_n in blocks:
                for pdl in (False, True):
                    got = triton_linear(x, weights[0], block_n, pdl).float()
                    want = torch.nn.functional.linear(x, weights[0]).float()
                    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item(), (name, rows, block_n)
                    calls: list[Callable[[], object]] = [
                        functools.partial(triton_linear, x, w, block_n, pdl) for w in weights
                    ]
                    cells.append(graph_ms(calls) * 1e3)
            print(f"{name:>9} {rows:>5} " + " ".join(f"{c:10.1f}" for c in cells), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
