"""Triton kernels whose per-row result does not depend on how many rows there are (`--deterministic` on CUDA).

cuBLAS picks its kernel, and whether to split the K reduction over blocks, by the matmul's shape, so a row's bits
change with M; PyTorch's CUDA reductions pick their block shape (and whether several blocks share a row) by the
number of outputs. Here the matmul is persistent over fixed 64 x 64 x 64 tiles, each tile's K loop in one program
from k = 0 up (no split-K, no atomics), and every row's mean is one program's loop over fixed chunks.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

# Fixed whatever the shape: the MMA instructions, and so each output's reduction order, follow from the tile alone.
# 64 x 64 output tiles rather than 128 x 128: a decode's few rows then still spread over 64-96 programs for an 8B
# projection (cuBLAS would split K instead). Untuned: `benchmarks/deterministic_bench.py` measures the cost.
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M = 64, 64, 64, 8
NUM_WARPS = 4
NUM_STAGES = {2: 4, 4: 2}  # by element size: float32 tiles take twice the shared memory
ROW_BLOCK = 1024  # elements of a row per iteration of the mean


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    M,
    N,
    K,
    s_am,
    s_ak,
    s_bk,
    s_bn,
    s_cm,
    s_cn,
    PROGRAMS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program p: output tiles p, p + PROGRAMS, ...; each tile's K loop from 0 in BLOCK_K steps, accumulated in
    float32 by tl.dot of full tiles (masked loads give zeros past M, N and K)."""
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_tiles = GROUP_M * tiles_n
    for tile in range(start, tiles_m * tiles_n, PROGRAMS):
        group = tile // group_tiles
        first_m = group * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % group_tiles) % group_m
        pid_n = (tile % group_tiles) // group_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            rk = k + tl.arange(0, BLOCK_K)
            a = tl.load(
                a_ptr + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak,
                mask=(rm < M)[:, None] & (rk < K)[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + rk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn,
                mask=(rk < K)[:, None] & (rn < N)[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        c = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for `a` `[M, K]` and `b` `[K, N]` (any strides) of one dtype: each output row's bits depend on its
    own row of `a` and on `b` only."""
    assert a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype, (a.shape, b.shape)
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    programs = min(_sm_count(a.device), tiles)
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        _matmul_kernel[(programs,)](
            a,
            b,
            out,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            PROGRAMS=programs,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            GROUP_M=GROUP_M,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES.get(a.element_size(), 2),
        )
    return out


@triton.jit
def _row_mean_kernel(x_ptr, out_ptr, s_row, width, BLOCK: tl.constexpr):
    """Program r: the mean of row r, summed in float32 over BLOCK-wide chunks from the row's start, then across."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * s_row + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, (tl.sum(acc, 0) / width).to(out_ptr.dtype.element_ty))


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """`x.mean(-1, keepdim=True)`, each row's reduction in one fixed order."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _row_mean_kernel[(rows.shape[0],)](rows, out, rows.stride(0), width, BLOCK=ROW_BLOCK)
    return out.view(*x.shape[:-1], 1)
