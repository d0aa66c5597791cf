"""Ways of reading K/V through block tables in the verify's attention kernel, timed side by side on the GPU.

An 8B verify's attention (32 query heads, 8 K/V heads, head 128, 5 queries per row) over rows at 512-768 keys, one
chunk per (row, K/V head) as at batch 32 and 64: the kernel as it is (`decode_attention`), then variants of its key
loop. The same tables twice: blocks of each row consecutive in the pool (as a slot cache's rows), and scattered.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from minedraft.kernels import decode_attention

# An attention over (query, key pool, value pool, block tables, rows, positions, scale)
Attend = Callable[..., torch.Tensor]
MASKED: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _variant_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    pos_ptr,
    out_ptr,
    sq_b,
    sq_h,
    sq_n,
    sk_blk,
    sk_h,
    sk_pos,
    st_row,
    sp_b,
    so_b,
    so_n,
    so_h,
    kv_heads,
    groups,
    queries,
    folded,
    scale,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MODE: tl.constexpr,
):
    """MODE 0: a table entry per key (as the kernel); 1: the tile's blocks loaded once, K/V as [blocks, size, dim];
    2: as 0 with the next tile's entries loaded a tile ahead; 3: as 1, K/V loads unmasked (past the end: block 0);
    5: as 2, loaded two tiles ahead (each K/V load's addresses a whole tile older). Offsets in int32 instead of int64
    (as 2) were slower on an H200: 65-66 against 61 us a layer."""
    bh = tl.program_id(0)
    b = bh // kv_heads
    h = bh % kv_heads
    r = tl.arange(0, ROWS)
    d = tl.arange(0, DIM)
    live = r < folded
    q_off = b * sq_b + (r % queries) * sq_n + (h * groups + r // queries) * sq_h
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=live[:, None], other=0.0)
    own = tl.load(pos_ptr + b * sp_b + (r % queries), mask=live, other=0)
    end = tl.max(own, 0) + 1
    table = table_ptr + tl.load(rows_ptr + b) * st_row
    k_head = k_ptr + h.to(tl.int64) * sk_h
    v_head = v_ptr + h.to(tl.int64) * sk_h
    m_i = tl.full([ROWS], MASKED, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    NB: tl.constexpr = BLOCK_N // BLOCK_SIZE
    j = tl.arange(0, NB)
    s16 = tl.arange(0, BLOCK_SIZE)
    n0 = tl.arange(0, BLOCK_N)
    ahead = tl.load(table + n0 // BLOCK_SIZE, mask=n0 < end, other=0).to(tl.int64)
    n1 = n0 + BLOCK_N
    further = tl.load(table + n1 // BLOCK_SIZE, mask=n1 < end, other=0).to(tl.int64)
    for start in range(0, end, BLOCK_N):
        n = start + n0
        inside = n < end
        if MODE == 0:
            block = tl.load(table + n // BLOCK_SIZE, mask=inside, other=0).to(tl.int64)
            off = block[:, None] * sk_blk + (n % BLOCK_SIZE)[:, None] * sk_pos + d[None, :]
            k = tl.load(k_head + off, mask=inside[:, None], other=0.0)
            v = tl.load(v_head + off, mask=inside[:, None], other=0.0)
        elif MODE == 2:
            off = ahead[:, None] * sk_blk + (n % BLOCK_SIZE)[:, None] * sk_pos + d[None, :]
            k = tl.load(k_head + off, mask=inside[:, None], other=0.0)
            v = tl.load(v_head + off, mask=inside[:, None], other=0.0)
            nn = n + BLOCK_N
            ahead = tl.load(table + nn // BLOCK_SIZE, mask=nn < end, other=0).to(tl.int64)
        elif MODE == 5:
            off = ahead[:, None] * sk_blk + (n % BLOCK_SIZE)[:, None] * sk_pos + d[None, :]
            k = tl.load(k_head + off, mask=inside[:, None], other=0.0)
            v = tl.load(v_head + off, mask=inside[:, None], other=0.0)
            nn = n + 2 * BLOCK_N
            ahead, further = further, tl.load(table + nn // BLOCK_SIZE, mask=nn < end, other=0).to(tl.int64)
        else:
            col = start // BLOCK_SIZE + j
            blocks = tl.load(table + col, mask=col * BLOCK_SIZE < end, other=0).to(tl.int64)
            off = blocks[:, None, None] * sk_blk + s16[None, :, None] * sk_pos + d[None, None, :]
            if MODE == 1:
                m3 = ((col * BLOCK_SIZE)[:, None] + s16[None, :] < end)[:, :, None]
                k = tl.reshape(tl.load(k_head + off, mask=m3, other=0.0), (BLOCK_N, DIM))
                v = tl.reshape(tl.load(v_head + off, mask=m3, other=0.0), (BLOCK_N, DIM))
            else:
                k = tl.reshape(tl.load(k_head + off), (BLOCK_N, DIM))
                v = tl.reshape(tl.load(v_head + off), (BLOCK_N, DIM))
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(live[:, None] & (n[None, :] <= own[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o_off = b * so_b + (r % queries) * so_n + (h * groups + r // queries) * so_h
    out = (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + o_off[:, None] + d[None, :], out, mask=live[:, None])


def variant(mode: int, block_n: int, stages: int) -> Attend:
    def attend(
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: torch.Tensor,
        rows: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        batch, heads, n, dim = query.shape
        _, kv_heads, block_size, _ = keys.shape
        groups = heads // kv_heads
        out = torch.empty(batch, n, heads, dim, dtype=query.dtype, device=query.device)
        _variant_kernel[(batch * kv_heads,)](
            query,
            keys,
            values,
            tables,
            rows,
            positions,
            out,
            query.stride(0),
            query.stride(1),
            query.stride(2),
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            tables.stride(0),
            positions.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            kv_heads,
            groups,
            n,
            groups * n,
            scale,
            ROWS=max(16, triton.next_power_of_2(groups * n)),
            DIM=dim,
            BLOCK_N=block_n,
            BLOCK_SIZE=block_size,
            MODE=mode,
            num_warps=4,
            num_stages=stages,
        )
        return out

    return attend


def current(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return decode_attention.paged_attention(query, keys, values, tables, rows, positions, scale, chunks=1)


def graph_us(calls: Sequence[Callable[[], object]], repeat: int = 20) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    times = []
    for _ in range(repeat):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(e) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slot", help="the slot cache's decode_attention.py (607e410), timed on contiguous rows too")
    args = parser.parse_args()
    torch.manual_seed(0)
    heads, kv_heads, dim, n, bs, width = 32, 8, 128, 5, 16, 64
    variants: dict[str, Attend] = {"current": current}
    for mode in (2, 5):
        for block_n in (32, 64):
            for stages in (2, 3, 4):
                variants[f"m{mode} n{block_n} s{stages}"] = variant(mode, block_n, stages)
    for batch in (int(b) for b in args.batches.split(",")):
        lengths = 512 + torch.randint(0, 768 - 512 - n + 1, (batch,), device="cuda")
        positions = lengths[:, None] + torch.arange(n, device="cuda")
        rows = torch.randperm(batch, device="cuda").to(torch.long)
        num_blocks = 1 + batch * width
        for layout in ("consecutive", "scattered"):
            if layout == "consecutive":
                tables = (1 + torch.arange(num_blocks - 1, device="cuda")).view(batch, width)
            else:
                tables = (1 + torch.randperm(num_blocks - 1, device="cuda")).view(batch, width)
            tables = tables.to(torch.int32).contiguous()
            pools = torch.randn(args.layers, 2, num_blocks, kv_heads, bs, dim, dtype=torch.bfloat16, device="cuda")
            query = torch.randn(batch, n, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
            ref = current(query, pools[0, 0], pools[0, 1], tables, rows, positions, dim**-0.5).float()
            results = {}
            for name, fn in variants.items():
                try:
                    out = fn(query, pools[0, 0], pools[0, 1], tables, rows, positions, dim**-0.5).float()
                    err = (out - ref).abs().max().item()
                    rest = (tables, rows, positions, dim**-0.5)
                    calls = [functools.partial(fn, query, p[0], p[1], *rest) for p in pools]
                    results[name] = (graph_us(calls), err)
                except Exception as exc:  # a variant Triton cannot compile
                    print(f"B={batch} {layout} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            ranked = sorted(results.items(), key=lambda kv: kv[1][0])
            kv_mb = 2 * batch * kv_heads * int(lengths.float().mean()) * dim * 2 / 1e6
            print(
                f"B={batch} {layout} ({kv_mb:.0f} MB K/V a layer): current {results['current'][0]:.1f} us; "
                + ", ".join(f"{k} {t:.1f}{'' if e < 0.05 else f' ERR{e:.2g}'}" for k, (t, e) in ranked[:10]),
                flush=True,
            )
            del pools
        if args.slot:
            spec = importlib.util.spec_from_file_location("slot_attention", args.slot)
            assert spec is not None and spec.loader is not None
            slot = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(slot)
            keys = torch.randn(args.layers, 2, batch, kv_heads, width * bs, dim, dtype=torch.bfloat16, device="cuda")
            calls = [
                functools.partial(slot.short_query_attention, query, kv[0], kv[1], None, dim**-0.5, positions, 1)
                for kv in keys
            ]
            print(f"B={batch} slot cache's kernel, rows of {width * bs} keys: {graph_us(calls):.1f} us", flush=True)
            del keys


if __name__ == "__main__":
    main()
