"""Time ways of reading a batch's keys out of the slot KV cache on the GPU (served verify: 8 ms of gather at B=32)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], torch.Tensor], repeat: int = 50) -> float:
    """Median milliseconds of `fn` on the GPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slots", type=int, default=65)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--kv-len", type=int, default=768)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    cache = torch.randn(args.slots, args.heads, args.max_len, args.head_dim, dtype=torch.bfloat16, device="cuda")
    by_position = cache.transpose(1, 2).contiguous()  # [slots, max_len, heads, head_dim]
    rows = torch.randperm(args.slots - 1, device="cuda")[: args.batch]
    kv = args.kv_len
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "advanced index cache[rows, :, :kv]": lambda: cache[rows, :, :kv],
        "index_select(cache[:, :, :kv], 0, rows)": lambda: torch.index_select(cache[:, :, :kv], 0, rows),
        "cache[rows] (all max_len positions)": lambda: cache[rows],
        "[slots, len, heads, dim] layout: c[rows, :kv]": lambda: by_position[rows, :kv].transpose(1, 2),
        "same layout, index_select": lambda: torch.index_select(by_position[:, :kv], 0, rows).transpose(1, 2),
        "view cache[:B, :, :kv] (contiguous rows)": lambda: cache[: args.batch, :, :kv],
    }
    reference = cache[rows, :, :kv]
    gathered_bytes = reference.numel() * reference.element_size()
    print(
        f"B={args.batch} kv_len={kv} max_len={args.max_len}: {gathered_bytes / 2**20:.0f} MiB per gather "
        f"(one layer's keys)"
    )
    for name, fn in variants.items():
        out = fn()
        same = torch.equal(out[:, :, :kv], reference) if "contiguous" not in name else True
        ms = timed(fn)
        print(f"{name:45s} {ms:7.3f} ms  {gathered_bytes / ms / 1e6:7.0f} GB/s of the needed bytes  equal={same}")


if __name__ == "__main__":
    main()
