"""A linear layer on a few rows (a decode or verify step's tokens) as a Triton kernel that streams the weight once.

A step's projections multiply a few rows by a large weight: bound by reading the weight. cuBLAS picks tiles for
such shapes that leave SMs idle: on an H200 an 8B verify's q/k/v projection (6144 x 4096, 5 rows) ran at ~67% of the
memory's bandwidth and the output projection at ~65% (run 15c, docs/benchmarks.md), against ~87% for the wide gate/up
projection. Here each program owns `BLOCK_N` output columns and walks the whole of K, so even a 4096-wide weight is
cut into 256 programs, with no split-K reduction after. The fused Llama modules' projections take it when `ENABLED`
(off until measured on a GPU: `benchmarks/linear_bench.py`, then whole steps); compiled layers call the custom
operator as it is.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

# Off until measured in whole steps on a GPU; MINEDRAFT_SKINNY_LINEAR=1 turns it on for a process (side-by-side runs).
ENABLED = os.environ.get("MINEDRAFT_SKINNY_LINEAR", "") == "1"
MAX_ROWS = 128  # more rows (prefills) go to cuBLAS, whose tiles suit them
# Output columns per program, K per loop step, pipeline stages and warps: None chooses them by rows (`tiles`); a
# number forces it (`benchmarks/linear_bench.py --sweep`). Read at each call.
BLOCK_N: int | None = None
BLOCK_K: int | None = None
NUM_STAGES: int | None = None
NUM_WARPS: int | None = None


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, rows, n_out, k_in, sx, sw, so,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program p: out[:, p*BLOCK_N : (p+1)*BLOCK_N] = x @ w[p*BLOCK_N : (p+1)*BLOCK_N].T (+ bias), over all of K."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m[:, None] * sx + k[None, :]
    w_ptrs = w_ptr + n[:, None] * sw + k[None, :]
    live_m = (m < rows)[:, None]
    live_n = (n < n_out)[:, None]
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for _ in range(0, k_in, BLOCK_K):  # k_in is a multiple of BLOCK_K (`supports`)
        x = tl.load(x_ptrs, mask=live_m, other=0.0)
        w = tl.load(w_ptrs, mask=live_n, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < n_out, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * so + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=live_m & (n < n_out)[None, :])


def tiles(rows: int) -> tuple[int, int, int, int, int]:
    """(padded rows, columns per program, K per loop step, stages, warps) for `rows` rows: the row tile grows with
    the rows and the K step shrinks, so that a stage's x and weight tiles stay about the same size."""
    padded = max(16, triton.next_power_of_2(rows))
    block_k = BLOCK_K or (256 if padded <= 32 else 128)
    return padded, BLOCK_N or 16, block_k, NUM_STAGES or 4, NUM_WARPS or 4


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this product: a 2-D contiguous weight whose K is a multiple of the K step, rows with
    a unit last stride, and at most `MAX_ROWS` of them."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (weight.dim() == 2 and weight.is_contiguous() and x.shape[-1] == weight.shape[1] and x.stride(-1) == 1
            and 0 < rows <= MAX_ROWS and x.dtype == weight.dtype and weight.shape[1] % tiles(rows)[2] == 0)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)` for x `[..., K]` of few rows (`supports`)."""
    flat = x.reshape(-1, x.shape[-1])
    rows, (n_out, k_in) = flat.shape[0], weight.shape
    out = torch.empty(rows, n_out, dtype=x.dtype, device=x.device)
    padded, block_n, block_k, stages, warps = tiles(rows)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _linear_kernel[(triton.cdiv(n_out, block_n),)](
            flat, weight, weight if bias is None else bias, out, rows, n_out, k_in, flat.stride(0), weight.stride(0),
            out.stride(0), ROWS=padded, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            PRECISION=precision, num_stages=stages, num_warps=warps,
        )
    return out.reshape(*x.shape[:-1], n_out)


@torch.library.custom_op("minedraft::linear", mutates_args=())
def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer that takes the kernel when it can and cuBLAS otherwise, decided per call on the rows: compiled
    layers call it as it is, so the choice adds no guard to them."""
    if supports(x, weight):
        return skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


@linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])

