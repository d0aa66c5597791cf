"""The verify's paged attention kernel against the slot cache's kernel, timed side by side on the GPU.

An 8B verify's attention (32 query heads, 8 K/V heads, head 128, 5 queries per row) over rows at 512-768 keys, one
chunk per (row, K/V head) as at batch 32 and 64: `decode_attention.paged_attention` over block tables whose blocks
are consecutive in the pool (as a slot cache's rows) and scattered; with `--slot`, the slot cache's kernel on
contiguous rows. The variants of the paged kernel's key loop once timed here were retired after f2a346f
(`git show f2a346f:benchmarks/paged_kernel_variants.py`).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.attention_bench import graph_ms  # noqa: E402
from minedraft.kernels import decode_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--slot", help="the slot cache's decode_attention.py (607e410), timed on contiguous rows too")
    args = parser.parse_args()
    torch.manual_seed(0)
    heads, kv_heads, dim, n, bs, width = 32, 8, 128, 5, 16, 64
    for batch in (int(b) for b in args.batches.split(",")):
        lengths = 512 + torch.randint(0, 768 - 512 - n + 1, (batch,), device="cuda")
        positions = lengths[:, None] + torch.arange(n, device="cuda")
        rows = torch.randperm(batch, device="cuda").to(torch.long)
        num_blocks = 1 + batch * width
        query = torch.randn(batch, n, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        kv_mb = 2 * batch * kv_heads * int(lengths.float().mean()) * dim * 2 / 1e6
        for layout in ("consecutive", "scattered"):
            order = torch.arange if layout == "consecutive" else torch.randperm
            tables = (1 + order(num_blocks - 1, device="cuda")).view(batch, width).to(torch.int32).contiguous()
            pools = torch.randn(args.layers, 2, num_blocks, kv_heads, bs, dim, dtype=torch.bfloat16, device="cuda")
            calls = [
                functools.partial(
                    decode_attention.paged_attention, query, p[0], p[1], tables, rows, positions, dim**-0.5, chunks=1
                )
                for p in pools
            ]
            print(f"B={batch} {layout} ({kv_mb:.0f} MB K/V a layer): {graph_ms(calls) * 1e3:.1f} us", flush=True)
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
            us = graph_ms(calls) * 1e3
            print(f"B={batch} slot cache's kernel, rows of {width * bs} keys: {us:.1f} us", flush=True)
            del keys


if __name__ == "__main__":
    main()
