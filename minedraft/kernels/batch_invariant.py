"""Triton kernels whose per-row result does not depend on how many rows there are (`--deterministic` on CUDA).

cuBLAS picks its kernel, and whether to split the K reduction over blocks, by the matmul's shape, so a row's bits
change with M; PyTorch's CUDA reductions pick their block shape (and whether several blocks share a row) by the
number of outputs. Here the matmul is persistent over fixed tiles (`CONFIG`, one for every shape), each tile's K loop
in one program from k = 0 up (no split-K, no atomics), and every row's mean is one program's loop over fixed chunks.
A batched matmul is the same kernel with the entry on a second grid axis: each entry's rows get the bits a lone
matmul gives them. `rms_norm` is a Llama RMSNorm in one kernel, one program per row.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl


class MatmulConfig(NamedTuple):
    """The matmul's tile and launch shape. The tile (block_m, block_n, block_k) and num_warps fix the MMA
    instructions and the K order of every output, so they are one for all shapes; stages and programs per SM only
    schedule the same arithmetic (which program computes a tile does not change its bits)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4  # (float32 tiles take twice the shared memory: half as many)
    programs_per_sm: int = 1

    def __str__(self) -> str:
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} p{self.programs_per_sm}"
        )


# The one config every matmul takes (read at each call). Chosen by `benchmarks/deterministic_bench.py` on one H100
# (docs/benchmarks.md): of ten tiles, 64 x 128 with two programs an SM is the least slower than torch.mm over decode
# and verify sizes (an 8B step's matmuls 1.04-1.49x cuBLAS's at M = 8-320).
CONFIG = MatmulConfig(block_n=128, programs_per_sm=2)
GROUP_M = 8
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
    s_ae,
    s_am,
    s_ak,
    s_be,
    s_bk,
    s_bn,
    s_ce,
    s_cm,
    s_cn,
    PROGRAMS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Program (p, e): entry e's output tiles p, p + PROGRAMS, ...; each tile's K loop from 0 in BLOCK_K steps,
    accumulated in float32 by tl.dot of full tiles (masked loads give zeros past M, N and K)."""
    start = tl.program_id(0)
    entry = tl.program_id(1).to(tl.int64)
    a_ptr += entry * s_ae
    b_ptr += entry * s_be
    c_ptr += entry * s_ce
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
            k_in = rk < K
            if EVEN_K:  # (no mask along K: the loads vectorise and pipeline alike; the same values either way)
                k_in = tl.full((BLOCK_K,), True, tl.int1)
            a = tl.load(
                a_ptr + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak,
                mask=(rm < M)[:, None] & k_in[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + rk[:, None].to(tl.int64) * s_bk + rn[None, :] * s_bn,
                mask=k_in[:, None] & (rn < N)[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        c = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def bmm(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """`a @ b` for `a` `[E, M, K]` and `b` `[E, K, N]` (any strides, a stride of 0 too) of one dtype, in one launch:
    each output row's bits depend on its own row of `a` and on its entry's `b` only, and equal `matmul`'s."""
    assert a.dim() == b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1], (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    config = config or CONFIG
    entries, m, k = a.shape
    n = b.shape[2]
    out = torch.empty(entries, m, n, dtype=a.dtype, device=a.device)
    if entries == 0 or m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    # Programs per entry: one wave over the SMs in all (entries share it), at least one each.
    programs = max(1, min(tiles, config.programs_per_sm * _sm_count(a.device) // entries))
    stages = config.num_stages if a.element_size() < 4 else max(2, config.num_stages // 2)
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        _matmul_kernel[(programs, entries)](
            a,
            b,
            out,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            a.stride(2),
            b.stride(0),
            b.stride(1),
            b.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            PROGRAMS=programs,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=GROUP_M,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            EVEN_K=k % config.block_k == 0,
            num_warps=config.num_warps,
            num_stages=stages,
        )
    return out


def matmul(a: torch.Tensor, b: torch.Tensor, config: MatmulConfig | None = None) -> torch.Tensor:
    """`a @ b` for `a` `[M, K]` and `b` `[K, N]` (any strides) of one dtype: each output row's bits depend on its
    own row of `a` and on `b` only."""
    assert a.dim() == b.dim() == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype, (a.shape, b.shape)
    return bmm(a[None], b[None], config)[0]


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


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, s_row, width, eps, BLOCK: tl.constexpr):
    """Program r: row r's mean square summed in float32 over BLOCK-wide chunks from the row's start, then across;
    then each element x * rsqrt(mean + eps) rounded to the output's type, times the weight, rounded again."""
    row = tl.program_id(0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        acc += x * x
    scale = 1.0 / tl.sqrt(tl.sum(acc, 0) / width + eps)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * s_row + cols, mask=cols < width, other=0.0).to(tl.float32)
        normed = (x * scale).to(out_ptr.dtype.element_ty).to(tl.float32)
        weight = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (weight * normed).to(out_ptr.dtype.element_ty), mask=cols < width)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)` (Llama's RMSNorm) for `weight` of
    `x`'s type, each row in one program: 1 kernel where the norm's operations are 7."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            block = min(ROW_BLOCK, triton.next_power_of_2(width))
            _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), width, eps, BLOCK=block)
    return out.view(x.shape)
