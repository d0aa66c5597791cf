"""Short-query attention over a paged K/V cache as Triton kernels: each K/V head's keys read once for all its queries.

A decode or verify step has a few queries per K/V head (query heads sharing it x new tokens) against hundreds of
keys. The fused SDPA kernels spread their work over (batch, head, query block): at batch 1 of an 8B verify, eight
blocks for the whole GPU. Here the keys of each (row, K/V head) are cut into chunks, one program per chunk
(flash-decoding); each program keeps a running softmax over its chunk, and a second kernel merges the chunks by
their log-sum-exp. A row's keys live in the blocks its row of the block table names, `block_size` positions each;
each tile's keys are found through the table, so the blocks may lie anywhere in the pool and be shared between rows.
Visibility is causal by the queries' positions (and a sliding window): no mask tensor is read. A row's keys are read
only up to its last query's position, and with a window only from its first query's window on, so a row pays for its
own length, not the table's, and the cache past it (a trash block, garbage) is never read. The chunk count
depends on shapes alone, so that CUDA graphs keyed by batch size replay it; each program sizes its chunk from its
row's actual length. The output is written as `[B, n, heads, head_dim]`, the layout the attention's output
projection reads, so no transpose copy follows.

A ragged step (TETRIS's verify, design section 14) passes its T tokens flattened, `[T, heads, D]`, with each row's
first token and token count: a program folds only its row's own queries (query heads x its tokens), reads and writes
them in place, and a program whose slice of folded queries holds none of them reads no keys, so short rows cost
short tiles and there is no padded `[B, n]` layout to scatter into and gather back from.

`fixed=True` (`--deterministic`) trades that split for one order per query row: programs take fixed blocks of
FIXED_ROWS folded queries, each loops over its row's keys in FIXED_KEYS tiles aligned to position 0, in order, and
nothing merges. A tile that a query cannot see leaves its running softmax exactly as it was, so each query's bits
depend on its own position only, not on the batch, the step's query count or the other queries of its block.
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
# The most folded queries (query heads sharing a K/V head x new tokens) one program takes: a step with more runs them
# in slices of this many, each slice's programs reading the keys again (None: all in one program, any number).
MAX_ROWS: int | None = None
# Ragged steps: folded queries per program (None: as MAX_ROWS does for the widest row). A row's slices launch side by
# side, so that slices after its first find its keys in L2.
RAGGED_ROWS: int | None = None
# `fixed` steps: folded queries per program and keys per tile, whatever the step (tl.dot's shapes, and so each score's
# reduction order, fixed).
FIXED_ROWS = 16
FIXED_KEYS = 64
# Where each query's running maximum starts: finite, so that a tile whose keys a query cannot see (scores -inf) adds
# exp(-inf - MASKED) = 0 and rescales by exp(0) = 1, where starting at -inf would give exp(-inf + inf) = NaN.
MASKED: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _folded_offset(b, h, r, groups, queries, first, s_b, s_n, s_h):
    """Offset of folded query `r` of K/V head `h` in row `b` of a `[B, n, heads]`-strided tensor: query head
    h*groups + r // queries (transformers' repeat_kv order), token first + r % queries (a ragged step's rows start
    at their `first` token of a flattened `[T, heads]` one, whose s_b is 0)."""
    own = tl.maximum(queries, 1)  # (a ragged row of no tokens folds none: every r is past it)
    return b * s_b + (first + r % own) * s_n + (h * groups + r // own) * s_h


@triton.jit
def _row_queries(counts_ptr, begins_ptr, b, queries, RAGGED: tl.constexpr):
    """(row b's tokens, its first token's index): a ragged step's own, else every row's `queries` from token 0."""
    if RAGGED:
        queries = tl.load(counts_ptr + b)
        first = tl.load(begins_ptr + b)
    else:
        first = 0
    return queries, first


@triton.jit
def _chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    pos_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    counts_ptr,
    begins_ptr,
    sq_b,
    sq_h,
    sq_n,
    s_blk,
    s_h,
    s_pos,
    st_row,
    sr,
    sp_b,
    sp_n,
    so_b,
    so_n,
    so_h,
    kv_heads,
    groups,
    queries,
    folded,
    window,
    scale,
    slices,
    ROWS: tl.constexpr,
    HEAD: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOW: tl.constexpr,
    FIXED: tl.constexpr,
    RAGGED: tl.constexpr,
):
    """Program (row x K/V head, chunk x slice): softmax(q k^T * scale) v over the chunk's visible keys, for the
    slice's ROWS of the `folded` queries of K/V head h (`_folded_offset`). FIXED: one chunk, all of the row's keys in
    tiles from a multiple of BLOCK_N, no split. RAGGED: the grid's axes swapped (a row's slices and chunks adjacent),
    each row its own token count (`_row_queries`)."""
    bh = tl.program_id(1) if RAGGED else tl.program_id(0)
    cs = tl.program_id(0) if RAGGED else tl.program_id(1)
    c = cs // slices
    chunks = (tl.num_programs(0) if RAGGED else tl.num_programs(1)) // slices
    b = bh // kv_heads
    h = bh % kv_heads
    queries, first_token = _row_queries(counts_ptr, begins_ptr, b, queries, RAGGED)
    if RAGGED:
        folded = groups * queries
    r = cs % slices * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, DIM)  # DIM: HEAD rounded up to a power of two (tl.dot's and tl.arange's sizes)
    live = r < folded
    # Masks along d only where the head is padded: an all-true one would still cost the loads their vector width.
    q_mask = live[:, None] if HEAD == DIM else live[:, None] & (d < HEAD)[None, :]
    q = tl.load(
        q_ptr + _folded_offset(b, h, r, groups, queries, first_token, sq_b, sq_n, sq_h)[:, None] + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    own = tl.load(pos_ptr + b * sp_b + (r % tl.maximum(queries, 1)) * sp_n, mask=live, other=0)
    # The row's keys: up to its last query's position; with a window, from its first query's window on. The row's
    # chunks split that span evenly (in whole tiles); on a short row the last chunks are empty and merge with weight 0.
    end = tl.max(own, 0) + 1
    if RAGGED:  # a slice past the row's own queries reads no keys
        end = tl.where(cs % slices * ROWS < folded, end, 0)
    begin = 0
    if WINDOW:
        begin = tl.maximum(tl.min(tl.where(live, own, end), 0) - window + 1, 0)
    if FIXED:
        first = begin // BLOCK_N * BLOCK_N
        chunk = end - first
    else:
        chunk = tl.cdiv(tl.cdiv(end - begin, chunks), BLOCK_N) * BLOCK_N
        first = begin + c * chunk
    table = table_ptr + tl.load(rows_ptr + b * sr) * st_row
    k_head, v_head = k_ptr + h.to(tl.int64) * s_h, v_ptr + h.to(tl.int64) * s_h
    m_i = tl.full([ROWS], MASKED, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    # Each tile's table entries are loaded a tile ahead: its K/V loads then wait on no load of their own iteration,
    # and Triton pipelines them (an 8B verify's attention at batch 32-64 on an H200: 20% faster than loading the
    # entries in the tile). Masked by the row's end: entries past it may name any block, or none. Block offsets in
    # int64, as a pool may hold more than 2^31 elements.
    ahead = first + tl.arange(0, BLOCK_N)
    block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0).to(tl.int64)
    for start in range(first, tl.minimum(first + chunk, end), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        inside = n < end
        if FIXED and WINDOW:  # (a fixed tile may start before the window, where the cache may hold anything)
            inside = inside & (n >= begin)
        seen = live[:, None] & (n[None, :] <= own[:, None])
        if WINDOW:  # transformers' sliding window: a query sees the `window` keys up to its own
            seen = seen & (n[None, :] > own[:, None] - window)
        slot = n % BLOCK_SIZE
        kv_mask = inside[:, None] if HEAD == DIM else inside[:, None] & (d < HEAD)[None, :]
        # K and V pools share their strides: one offset for both (computing each its own: 10% slower at batch 64).
        kv = block[:, None] * s_blk + slot[:, None] * s_pos + d[None, :]
        k = tl.load(k_head + kv, mask=kv_mask, other=0.0)
        v = tl.load(v_head + kv, mask=kv_mask, other=0.0)
        ahead = (n + BLOCK_N).to(ahead.dtype)  # (n is int64 where the loop starts at a constant: the fixed mode's 0)
        block = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < end, other=0).to(tl.int64)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:
        part = part_ptr + (bh * chunks + c) * slices * ROWS * DIM
        tl.store(part + r[:, None] * DIM + d[None, :], acc / tl.maximum(l_i, 1e-30)[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + (bh * chunks + c) * slices * ROWS + r, lse)
    else:
        out = out_ptr + _folded_offset(b, h, r, groups, queries, first_token, so_b, so_n, so_h)[:, None]
        tl.store(out + d[None, :], (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    counts_ptr,
    begins_ptr,
    so_b,
    so_n,
    so_h,
    kv_heads,
    groups,
    queries,
    chunks,
    ROWS: tl.constexpr,
    HEAD: tl.constexpr,
    DIM: tl.constexpr,
    CHUNKS: tl.constexpr,
    RAGGED: tl.constexpr,
):
    """Program (row x K/V head, folded query): the chunks' outputs weighted by exp(their log-sum-exp); an empty
    chunk's is -inf, weight 0. RAGGED: a folded query past the row's own writes nothing."""
    bh = tl.program_id(0)
    r = tl.program_id(1)
    b = bh // kv_heads
    h = bh % kv_heads
    queries, first_token = _row_queries(counts_ptr, begins_ptr, b, queries, RAGGED)
    c = tl.arange(0, CHUNKS)
    d = tl.arange(0, DIM)
    lse = tl.load(lse_ptr + (bh * chunks + c) * ROWS + r, mask=c < chunks, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp(lse - top), 0.0)
    parts = tl.load(
        part_ptr + ((bh * chunks + c) * ROWS + r)[:, None] * DIM + d[None, :], mask=(c < chunks)[:, None], other=0.0
    )
    merged = tl.sum(parts * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    out = out_ptr + _folded_offset(b, h, r, groups, queries, first_token, so_b, so_n, so_h)
    mask = d < tl.where(r < groups * queries, HEAD, 0) if RAGGED else None if HEAD == DIM else d < HEAD
    tl.store(out + d, merged.to(out_ptr.dtype.element_ty), mask=mask)


def supports(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the kernels take these shapes: queries `[B, heads, n, D]` and pools `[num_blocks, kv_heads,
    block_size, D]` of one head size of 16 or more, contiguous along it and strided alike, query heads a multiple of the
    K/V heads."""
    dim = query.shape[-1]
    return (
        query.dim() == key_cache.dim() == value_cache.dim() == 4
        and dim >= 16
        and key_cache.shape == value_cache.shape
        and key_cache.stride() == value_cache.stride()
        and key_cache.shape[-1] == dim
        and query.shape[1] % key_cache.shape[1] == 0
        and query.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == 1
    )


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def tiles(blocks: int, queries: int, device: torch.device) -> tuple[int, int, int]:
    """(keys per tile, programs per SM, pipeline stages) for a step of `blocks` (row, K/V head) blocks and `queries`
    tokens per row.

    From sweeps on an H200 (`benchmarks/attention_bench.py --sweep`; us per layer at prefix 512, rows at 512-768 keys,
    paged, each tile's table entries loaded a tile ahead): steps of several tokens take 64-key tiles, one program per
    SM (each reads its keys for all of them) and three stages (8B verify at batch 32, 64: 36.3, 67.0; 128-key tiles
    47.4, 88.7); one-token decodes take three stages, two programs per SM and 64-key tiles while the blocks are fewer
    than four per SM, 128 beyond (68M decode at 16, 32, 64: 18.0, 22.9, 41.7 against 19.6, 24.2, 42.8 with two
    stages; 1B at 16 and 64: 13.7, 28.7 against 16.4, 39.1). At batch 1 either is within noise (68M 6.2 against 5.4).
    """
    several = queries > 1
    block_keys = BLOCK_KEYS or (64 if several or blocks < 4 * _sm_count(device) else 128)
    return block_keys, PROGRAMS_PER_SM or (1 if several else 2), NUM_STAGES or 3


def chunks_for(blocks: int, keys: int, block_keys: int, programs_per_sm: int, device: torch.device) -> int:
    """How many chunks each (row, K/V head) block's keys are cut into: as many as fit in one wave of
    `programs_per_sm` programs on every SM, and no more than `keys` (the longest a row can be) has tiles. Rounding up
    instead (a second, partial wave; and a merge where one chunk fits) was 20-25% slower for an 8B verify at batch 8
    and 16."""
    wanted = programs_per_sm * _sm_count(device) // blocks
    return max(1, min(wanted, math.ceil(keys / block_keys)))


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
    chunks: int | None = None,
    fixed: bool = False,
    begins: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for `query` `[B, heads, n, D]` (any strides with a unit last one: the query as the
    projections leave it, transposed, is read without a copy) over one layer's pools `key_cache`/`value_cache`
    `[num_blocks, kv_heads, block_size, D]` (unit last stride, the same strides); returns `[B, n, heads, D]`.

    Entry b's keys are row `rows[b]` of `block_tables` `[R, M]` (int32, unit last stride): position p in block
    `block_tables[rows[b], p // block_size]` at `p % block_size`. Query i of entry b sees the keys at positions up to
    `positions[b, i]` (`[B, n]`), with `window` > 0 only the last `window` of them. `chunks`: how many chunks each
    K/V head's keys are cut into (default: `chunks_for` the longest row the table holds); on the host nothing depends
    on the rows' lengths, so CUDA graphs may capture the call. `fixed`: each query's result independent of the
    step's shape (module docstring), for any number of queries.

    A ragged step passes `begins` and `counts` (`[B]` each): `query` is then `[T, heads, D]` flattened, row b's
    tokens `begins[b]` to `begins[b] + counts[b]` (counts up to n, 0 allowed; positions past a row's count unread),
    and the result `[T, heads, D]`; a token of no row (padding past the rows' tokens) is left unwritten (never read:
    each token's rows stay its own).
    """
    ragged = None if begins is None or counts is None else (begins, counts)
    if ragged is None:
        batch, heads, queries, head = query.shape
        out = torch.empty(batch, queries, heads, head, dtype=query.dtype, device=query.device)
        q_strides = (query.stride(0), query.stride(2), query.stride(1))
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
    else:  # (a row's tokens are rows of the flattened tensors: no stride between rows)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        q_strides = (0, query.stride(0), query.stride(1))
        o_strides = (0, out.stride(0), out.stride(1))
    args = (query, q_strides, out, o_strides, ragged, key_cache, value_cache, block_tables, rows, positions)
    _launch(*args, scale, window, chunks, fixed)
    return out


def _launch(
    query: torch.Tensor,
    q_strides: tuple[int, int, int],
    out: torch.Tensor,
    o_strides: tuple[int, int, int],
    ragged: tuple[torch.Tensor, torch.Tensor] | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int,
    chunks: int | None,
    fixed: bool,
) -> None:
    """The kernels over queries and outputs addressed by (row, token, head) strides; `ragged`: (begins, counts)."""
    batch, queries = positions.shape
    heads, head = query.shape[1], query.shape[-1]
    _, kv_heads, block_size, _ = key_cache.shape
    groups = heads // kv_heads
    folded = groups * queries
    dim = triton.next_power_of_2(head)
    block_keys, programs_per_sm, stages = tiles(batch * kv_heads, queries, query.device)
    longest = block_tables.shape[1] * block_size
    # The second grid axis (the first of a ragged step's): chunks x slices of `rows` folded queries.
    if fixed:
        block_keys, rows_each = FIXED_KEYS, FIXED_ROWS
        slices, chunks = triton.cdiv(folded, rows_each), 1
    else:
        cap = MAX_ROWS if ragged is None else RAGGED_ROWS or MAX_ROWS
        rows_each = max(16, triton.next_power_of_2(folded if cap is None else min(folded, cap)))
        slices = triton.cdiv(folded, rows_each)
        blocks = batch * kv_heads * slices
        chunks = chunks or CHUNKS or chunks_for(blocks, longest, block_keys, programs_per_sm, query.device)
    split = chunks > 1
    padded_rows = slices * rows_each
    part = torch.empty(
        batch * kv_heads * chunks * padded_rows * dim if split else 1, dtype=torch.float32, device=query.device
    )
    lse = torch.empty(batch * kv_heads * chunks * padded_rows if split else 1, dtype=torch.float32, device=query.device)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    assert query.stride(-1) == key_cache.stride(-1) == value_cache.stride(-1) == block_tables.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    if tuple(rows.shape) != (batch,) or (ragged is None and (query.shape[0], query.shape[2]) != (batch, queries)):
        raise ValueError(
            f"paged attention needs rows as [{batch}] and positions as [{batch}, {queries}] for its queries "
            f"{list(query.shape)}, got {list(rows.shape)} and {list(positions.shape)}"
        )
    begins, counts = ragged if ragged is not None else (rows, rows)  # (unread where the step is not ragged)
    grid = (batch * kv_heads, chunks * slices) if ragged is None else (chunks * slices, batch * kv_heads)
    # Triton launches on the current device, not the tensors' (a draft on a second GPU in the target's process).
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        _chunk_kernel[grid](
            query,
            key_cache,
            value_cache,
            block_tables,
            rows,
            positions,
            part,
            lse,
            out,
            counts,
            begins,
            q_strides[0],
            q_strides[2],
            q_strides[1],
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            block_tables.stride(0),
            rows.stride(0),
            positions.stride(0),
            positions.stride(1),
            o_strides[0],
            o_strides[1],
            o_strides[2],
            kv_heads,
            groups,
            queries,
            folded,
            window,
            scale,
            slices,
            ROWS=rows_each,
            HEAD=head,
            DIM=dim,
            BLOCK_N=block_keys,
            BLOCK_SIZE=block_size,
            SPLIT=split,
            PRECISION=precision,
            WINDOW=window > 0,
            FIXED=fixed,
            RAGGED=ragged is not None,
            num_warps=NUM_WARPS,
            num_stages=stages,
        )
        if split:
            _merge_kernel[(batch * kv_heads, folded)](
                part,
                lse,
                out,
                counts,
                begins,
                o_strides[0],
                o_strides[1],
                o_strides[2],
                kv_heads,
                groups,
                queries,
                chunks,
                ROWS=padded_rows,
                HEAD=head,
                DIM=dim,
                CHUNKS=triton.next_power_of_2(chunks),
                RAGGED=ragged is not None,
            )


@torch.library.custom_op("minedraft::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
    fixed: bool = False,
    begins: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` as an operator that compiled layers call as it is (inductor does not trace into it)."""
    args = (query, key_cache, value_cache, block_tables, rows, positions, scale, window)
    return paged_attention(*args, fixed=fixed, begins=begins, counts=counts)


@paged_attention_op.register_fake
def _(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int = 0,
    fixed: bool = False,
    begins: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    if begins is not None:
        return torch.empty_like(query, memory_format=torch.contiguous_format)
    batch, heads, queries, dim = query.shape
    return query.new_empty(batch, queries, heads, dim)
