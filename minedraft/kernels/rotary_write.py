"""A step's rotary embedding and K/V cache write as one Triton kernel, from the fused Q/K/V projection's output.

Compiled, these were three kernels per layer (the queries' rotation; the keys' rotation with their scatter into the
cache; the values' scatter): 10.9 us of an 8B verify's layer at batch 16 on an H200, for a few hundred kB.
One program per (token, head) rotates or copies its head's vector and stores it where it goes: the queries to a
`[B, n, heads, D]` tensor, keys and values to their rows and positions in the cache. The arithmetic rounds as
transformers' eager code does (each product and the sum to the input's type), so eager steps give the same bits on
either path; compiled layers rounded once, at the sum.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_write_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    query_ptr,
    keys_ptr,
    values_ptr,
    rows_ptr,
    pos_ptr,
    sx_b,
    sx_n,
    sc_b,
    sc_n,
    ss_b,
    ss_n,
    sq_b,
    sq_n,
    sk_row,
    sk_head,
    sk_pos,
    sr,
    sp_b,
    sp_n,
    queries,
    heads,
    kv_heads,
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program (token b * queries + i, head): head < heads a query head, then the K heads, then the V heads."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    b = token // queries
    i = token % queries
    d = tl.arange(0, BLOCK)  # BLOCK: DIM rounded up to a power of two
    inside = d < DIM
    source = x_ptr + b * sx_b + i * sx_n + head * DIM
    x = tl.load(source + d, mask=inside)
    if head < heads + kv_heads:  # rotated: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        partner = tl.load(source + (d + DIM // 2) % DIM, mask=inside).to(tl.float32)
        cos = tl.load(cos_ptr + b * sc_b + i * sc_n + d, mask=inside).to(tl.float32)
        sin = tl.load(sin_ptr + b * ss_b + i * ss_n + d, mask=inside).to(tl.float32)
        turned = tl.where(d < DIM // 2, -partner, partner)
        product = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
        x = (product + (turned * sin).to(x.dtype).to(tl.float32)).to(x.dtype)
    if head < heads:
        tl.store(query_ptr + b * sq_b + i * sq_n + head * DIM + d, x, mask=inside)
    else:
        place = tl.load(rows_ptr + b * sr) * sk_row + tl.load(pos_ptr + b * sp_b + i * sp_n) * sk_pos + d
        if head < heads + kv_heads:
            tl.store(keys_ptr + place + (head - heads) * sk_head, x, mask=inside)
        else:
            tl.store(values_ptr + place + (head - heads - kv_heads) * sk_head, x, mask=inside)


def supports(projections: torch.Tensor, cos: torch.Tensor, keys: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel takes these: a CUDA step, an even head size rotated whole, unit last strides, the cache in
    the projections' type."""
    return (
        projections.is_cuda
        and head_dim % 2 == 0
        and cos.shape[-1] == head_dim
        and projections.stride(-1) == cos.stride(-1) == 1
        and keys.dtype == projections.dtype
    )


def rotate_and_write(
    projections: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """The rotated queries `[B, n, heads, D]` of `projections` `[B, n, (heads + 2 kv_heads) D]`; writes the rotated
    keys and the values to `keys`/`values` `[rows, kv_heads, length, D]` (one layer's) at `rows[b]`, positions
    `positions[b, i]`. `cos`/`sin`: `[B or 1, n, D]`."""
    batch, queries = projections.shape[:2]
    dim = keys.shape[-1]
    query = projections.new_empty(batch, queries, heads, dim)
    cos, sin = cos.expand(batch, queries, dim), sin.expand(batch, queries, dim)
    assert keys.stride() == values.stride() and sin.stride(-1) == 1
    # Triton launches on the current device, not the tensors' (a draft on a second GPU in the target's process).
    with torch.cuda.device(projections.device) if projections.is_cuda else contextlib.nullcontext():
        _rotary_write_kernel[(batch * queries, heads + 2 * kv_heads)](
            projections,
            cos,
            sin,
            query,
            keys,
            values,
            rows,
            positions,
            projections.stride(0),
            projections.stride(1),
            cos.stride(0),
            cos.stride(1),
            sin.stride(0),
            sin.stride(1),
            query.stride(0),
            query.stride(1),
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            rows.stride(0),
            positions.stride(0),
            positions.stride(1),
            queries,
            heads,
            kv_heads,
            # No fused multiply-add: eager rounds the product before the sum.
            DIM=dim,
            BLOCK=triton.next_power_of_2(dim),
            num_warps=1,
            enable_fp_fusion=False,
        )
    return query
