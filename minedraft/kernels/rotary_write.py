"""A step's rotary embedding and K/V cache write as one Triton kernel, from the fused Q/K/V projection's output.

Compiled, these were three kernels per layer (the queries' rotation; the keys' rotation with their scatter into the
cache; the values' scatter): 10.9 us of an 8B verify's layer at batch 16 on an H200, for a few hundred kB.
One program per (token, head) rotates or copies its head's vector and stores it where it goes: the queries to a
`[B, n, heads, D]` tensor, keys and values to their blocks and offsets in the paged cache, through the row's block
table. The arithmetic rounds as transformers' eager code does (each product and the sum to the input's type), so
eager steps give the same bits on either path; compiled layers rounded once, at the sum.
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
    table_ptr,
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
    sk_blk,
    sk_head,
    sk_pos,
    st_row,
    sr,
    sp_b,
    sp_n,
    queries,
    heads,
    kv_heads,
    DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (token b * queries + i, head): head < heads a query head, then the K heads, then the V heads."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    b = token // queries
    i = token % queries
    d = tl.arange(0, BLOCK_D)  # BLOCK_D: DIM rounded up to a power of two
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
        # Position p of the row lives in block table[row, p // BLOCK_SIZE] at p % BLOCK_SIZE; the block's offset in
        # int64, as a pool may hold more than 2^31 elements.
        position = tl.load(pos_ptr + b * sp_b + i * sp_n)
        block = tl.load(table_ptr + tl.load(rows_ptr + b * sr) * st_row + position // BLOCK_SIZE).to(tl.int64)
        place = block * sk_blk + (position % BLOCK_SIZE) * sk_pos + d
        if head < heads + kv_heads:
            tl.store(keys_ptr + place + (head - heads) * sk_head, x, mask=inside)
        else:
            tl.store(values_ptr + place + (head - heads - kv_heads) * sk_head, x, mask=inside)


def supports(projections: torch.Tensor, cos: torch.Tensor, key_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether the kernel takes these: a CUDA step, an even head size rotated whole, a pool `[num_blocks, kv_heads,
    block_size, head_dim]` in the projections' type, unit last strides."""
    return (
        projections.is_cuda
        and head_dim % 2 == 0
        and cos.shape[-1] == head_dim
        and key_cache.dim() == 4
        and key_cache.shape[-1] == head_dim
        and projections.stride(-1) == cos.stride(-1) == key_cache.stride(-1) == 1
        and key_cache.dtype == projections.dtype
    )


def rotate_and_write(
    projections: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """The rotated queries `[B, n, heads, D]` of `projections` `[B, n, (heads + 2 kv_heads) D]`; writes the rotated
    keys and the values of token (b, i) to one layer's pools `key_cache`/`value_cache` `[num_blocks, kv_heads,
    block_size, D]` at block `block_tables[rows[b], positions[b, i] // block_size]` (`block_tables` `[R, M]`, int32),
    offset `positions[b, i] % block_size`. `cos`/`sin`: `[B or 1, n, D]`."""
    batch, queries = projections.shape[:2]
    dim = key_cache.shape[-1]
    query = projections.new_empty(batch, queries, heads, dim)
    cos, sin = cos.expand(batch, queries, dim), sin.expand(batch, queries, dim)
    assert key_cache.stride() == value_cache.stride() and sin.stride(-1) == block_tables.stride(-1) == 1
    # Triton launches on the current device, not the tensors' (a draft on a second GPU in the target's process).
    with torch.cuda.device(projections.device) if projections.is_cuda else contextlib.nullcontext():
        _rotary_write_kernel[(batch * queries, heads + 2 * kv_heads)](
            projections,
            cos,
            sin,
            query,
            key_cache,
            value_cache,
            block_tables,
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
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            rows.stride(0),
            positions.stride(0),
            positions.stride(1),
            queries,
            heads,
            kv_heads,
            # No fused multiply-add: eager rounds the product before the sum.
            DIM=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            BLOCK_SIZE=key_cache.shape[2],
            num_warps=1,
            enable_fp_fusion=False,
        )
    return query
