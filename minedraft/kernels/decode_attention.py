"""Short-query attention over slot-cache K/V as Triton kernels: each K/V head's keys read once for all its queries.

A decode or verify step has a few queries per K/V head (query heads sharing it x new tokens) against hundreds of
keys. The fused SDPA kernels spread their work over (batch, head, query block): at batch 1 of an 8B verify, eight
blocks for the whole GPU. Here the keys of each (row, K/V head) are cut into chunks, one program per chunk
(flash-decoding); each program keeps a running softmax over its chunk, and a second kernel merges the chunks by
their log-sum-exp. Given the queries' positions, a row's keys are read only up to its last query's position, so a
row pays for its own length, not the batch's key bucket; the loop then has no branch and Triton pipelines its
loads. Without a mask (a causal step's, which the positions alone define) no mask tile is loaded beside each K/V
tile either. The output is written as `[B, n, heads, head_dim]`, the layout the attention's output projection reads, so
no transpose copy follows.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

# Keys per tile, programs wanted per SM (chunks are made while rows x K/V heads x chunks fits that many per SM),
# tiles in flight per program (Triton's software pipelining of the chunk loop) and chunks per (row, K/V head): None
# chooses them per step (`tiles`, `chunks_for`); a number forces it (`benchmarks/attention_bench.py --sweep`). Read at
# each call.
BLOCK_KEYS: int | None = None
PROGRAMS_PER_SM: int | None = None
NUM_STAGES: int | None = None
CHUNKS: int | None = None
NUM_WARPS = 4  # of the chunk kernel
# Where each query's running maximum starts: above any masking value (transformers' masks use the dtype's minimum),
# so keys the mask hides add exp(minimum - MASKED) = 0 even before a visible one.
MASKED: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _folded_offset(b, h, r, groups, queries, s_b, s_n, s_h):
    """Offset of folded query `r` of K/V head `h` in row `b` of a `[B, n, heads]`-strided tensor: query head
    h*groups + r // queries (transformers' repeat_kv order), position r % queries."""
    return b * s_b + (r % queries) * s_n + (h * groups + r // queries) * s_h


@triton.jit
def _chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    pos_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    sq_b,
    sq_h,
    sq_n,
    sk_b,
    sk_h,
    sk_n,
    sv_b,
    sv_h,
    sv_n,
    sm_b,
    sm_q,
    sm_n,
    sp_b,
    sp_n,
    so_b,
    so_n,
    so_h,
    kv_heads,
    groups,
    queries,
    rows,
    keys,
    chunk,
    scale,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    POSITIONS: tl.constexpr,
    MASK: tl.constexpr,
):
    """Program (row x K/V head, chunk): softmax(q k^T * scale + mask) v over the chunk's keys, for the `rows`
    folded queries of K/V head h (`_folded_offset`)."""
    bh = tl.program_id(0)
    c = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    r = tl.arange(0, ROWS)
    d = tl.arange(0, DIM)
    live = r < rows
    q = tl.load(
        q_ptr + _folded_offset(b, h, r, groups, queries, sq_b, sq_n, sq_h)[:, None] + d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    mask_rows = mask_ptr + b * sm_b + (r % queries)[:, None] * sm_q
    end = keys
    if POSITIONS:  # causal: no query of the row sees a key past its own position
        own = tl.load(pos_ptr + b * sp_b + (r % queries) * sp_n, mask=live, other=0)
        end = tl.minimum(end, tl.max(own, 0) + 1)
    m_i = tl.full([ROWS], MASKED, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    for start in range(c * chunk, tl.minimum(c * chunk + chunk, end), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < end
        if MASK:
            bias = tl.load(mask_rows + n[None, :] * sm_n, mask=live[:, None] & inside[None, :], other=float("-inf"))
        else:  # causal by the positions alone: no load for the loop's loads to wait on
            bias = tl.where(live[:, None] & (n[None, :] <= own[:, None]), 0.0, float("-inf"))
        k = tl.load(k_ptr + b * sk_b + h * sk_h + n[:, None] * sk_n + d[None, :], mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + n[:, None] * sv_n + d[None, :], mask=inside[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale + bias.to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:
        part = part_ptr + (bh * tl.num_programs(1) + c) * ROWS * DIM
        tl.store(part + r[:, None] * DIM + d[None, :], acc / tl.maximum(l_i, 1e-30)[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + (bh * tl.num_programs(1) + c) * ROWS + r, lse)
    else:
        out = out_ptr + _folded_offset(b, h, r, groups, queries, so_b, so_n, so_h)[:, None]
        tl.store(
            out + d[None, :], (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=live[:, None]
        )


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    so_b,
    so_n,
    so_h,
    kv_heads,
    groups,
    queries,
    chunks,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Program (row x K/V head, folded query): the chunks' outputs weighted by exp(their log-sum-exp)."""
    bh = tl.program_id(0)
    r = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    c = tl.arange(0, CHUNKS)
    d = tl.arange(0, DIM)
    lse = tl.load(lse_ptr + (bh * chunks + c) * ROWS + r, mask=c < chunks, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    parts = tl.load(
        part_ptr + ((bh * chunks + c) * ROWS + r)[:, None] * DIM + d[None, :], mask=(c < chunks)[:, None], other=0.0
    )
    merged = tl.sum(parts * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    out = out_ptr + _folded_offset(b, h, r, groups, queries, so_b, so_n, so_h)
    tl.store(out + d, merged.to(out_ptr.dtype.element_ty))


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the kernels take these shapes: one power-of-two head size of 16 or more for queries, keys and values,
    contiguous along it, and a mask of one row per query."""
    dim = query.shape[-1]
    return (
        dim >= 16
        and dim & (dim - 1) == 0
        and key.shape[-1] == value.shape[-1] == dim
        and mask.shape[2] == query.shape[2]
        and query.stride(-1) == key.stride(-1) == value.stride(-1) == mask.stride(-1) == 1
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def tiles(blocks: int, queries: int, device: torch.device) -> tuple[int, int, int]:
    """(keys per tile, programs per SM, pipeline stages) for a step of `blocks` (row, K/V head) blocks and `queries`
    tokens per row.

    From a sweep on an H200 (us per layer at prefix 512, rows at 512-768 keys): steps of several tokens
    take 64-key tiles, one program per SM (each reads its keys for all of them) and three stages (8B verify at
    batch 1, 16, 32: 7.4, 25.3, 32.9; 128-key tiles 48.4 at 32); one-token decodes take 64-key tiles while the blocks
    are fewer than the SMs, 128 beyond, two programs per SM and two stages (68M decode at 1, 16, 32: 5.5, 15.0, 22.3;
    three stages 5.7, 18.2, 27.2).
    """
    several = queries > 1
    block_keys = BLOCK_KEYS or (64 if several or blocks < _sm_count(device) else 128)
    return block_keys, PROGRAMS_PER_SM or (1 if several else 2), NUM_STAGES or (3 if several else 2)


def chunks_for(blocks: int, keys: int, block_keys: int, programs_per_sm: int, device: torch.device) -> int:
    """How many chunks each (row, K/V head) block's keys are cut into: as many as fit in one wave of
    `programs_per_sm` programs on every SM. Rounding up instead (a second, partial wave; and a merge where one chunk
    fits) was 20-25% slower for an 8B verify at batch 8 and 16."""
    wanted = programs_per_sm * _sm_count(device) // blocks
    return max(1, min(wanted, math.ceil(keys / block_keys)))


def short_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    positions: torch.Tensor | None = None,
    chunks: int | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for `query` `[B, heads, n, D]` over `key`/`value` `[B, kv_heads, L, D]` (any
    strides with a unit last one: the query as the projections leave it, transposed, is read without a copy) and an
    additive `mask` `[B, 1, n, L]`; returns `[B, n, heads, D]`.

    `positions` (`[B, n]`, optional): the queries' positions in a causal step, whose mask hides every key past them;
    each row then reads keys only up to its last query's. Without a mask (positions required), each query sees
    exactly the keys up to its own position. `chunks`: how many chunks each K/V head's keys are cut into (default:
    `chunks_for`).
    """
    batch, heads, queries, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = groups * queries
    out = torch.empty(batch, queries, heads, dim, dtype=query.dtype, device=query.device)
    block_keys, programs_per_sm, stages = tiles(batch * kv_heads, queries, query.device)
    chunks = chunks or CHUNKS or chunks_for(batch * kv_heads, keys, block_keys, programs_per_sm, query.device)
    chunk = math.ceil(math.ceil(keys / chunks) / block_keys) * block_keys
    chunks = math.ceil(keys / chunk)
    padded_rows = max(16, triton.next_power_of_2(rows))
    split = chunks > 1
    part = torch.empty(
        batch * kv_heads * chunks * padded_rows * dim if split else 1, dtype=torch.float32, device=query.device
    )
    lse = torch.empty(batch * kv_heads * chunks * padded_rows if split else 1, dtype=torch.float32, device=query.device)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1 and (mask is None or mask.stride(-1) == 1)
    mask_strides = (0, 0, 0) if mask is None else (mask.stride(0), mask.stride(2), mask.stride(3))
    limits = positions if positions is not None and tuple(positions.shape) == (batch, queries) else None
    if mask is None and limits is None:
        raise ValueError(f"attention without a mask needs the queries' positions as [{batch}, {queries}]")
    # Triton launches on the current device, not the tensors' (a draft on a second GPU in the target's process).
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _chunk_kernel[(batch * kv_heads, chunks)](
            query,
            key,
            value,
            lse if mask is None else mask,
            lse if limits is None else limits,
            part,
            lse,
            out,
            query.stride(0),
            query.stride(1),
            query.stride(2),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            value.stride(0),
            value.stride(1),
            value.stride(2),
            *mask_strides,
            *((0, 0) if limits is None else limits.stride()),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            kv_heads,
            groups,
            queries,
            rows,
            keys,
            chunk,
            scale,
            ROWS=padded_rows,
            DIM=dim,
            BLOCK_N=block_keys,
            SPLIT=split,
            PRECISION=precision,
            POSITIONS=limits is not None,
            MASK=mask is not None,
            num_warps=NUM_WARPS,
            num_stages=stages,
        )
        if split:
            _merge_kernel[(batch * kv_heads, rows)](
                part,
                lse,
                out,
                out.stride(0),
                out.stride(1),
                out.stride(2),
                kv_heads,
                groups,
                queries,
                chunks,
                ROWS=padded_rows,
                DIM=dim,
                CHUNKS=triton.next_power_of_2(chunks),
            )
    return out


@torch.library.custom_op("minedraft::short_query_attention", mutates_args=())
def short_query_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """`short_query_attention` as an operator that compiled layers call as it is (inductor does not trace into it)."""
    return short_query_attention(query, key, value, mask, scale, positions)


@short_query_attention_op.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    batch, heads, queries, dim = query.shape
    return query.new_empty(batch, queries, heads, dim)
