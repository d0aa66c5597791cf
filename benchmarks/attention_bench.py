"""The step attention's paths alone on the GPU, compiled, at real steps' shapes, over a paged K/V cache.

The paths: the Triton paged-attention kernels, and for comparison fused SDPA and two matmuls over each row's keys
gathered through its block table.

A layer's attention alone does not predict a whole step's: choose paths by whole-step
A/Bs (`benchmarks/gpu_run.sh ab compile`) and use this to see where the paths stand against the K/V floor.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable, Sequence

import torch

from minedraft.kernels import decode_attention

# name -> (query heads, K/V heads, head dim, new tokens per step): an 8B verify of k=4 drafts, 1B and 68M decode steps.
SHAPES = {"8b-verify": (32, 8, 128, 5), "1b-decode": (32, 8, 64, 1), "68m-decode": (12, 12, 64, 1)}
PATHS = ("kernel", "fused", "matmuls")
# Sweeps: the decode_attention settings each varies, and their values.
SWEEPS = {
    "tiles": (
        ("BLOCK_KEYS", "PROGRAMS_PER_SM", "NUM_WARPS", "NUM_STAGES"),
        ((32, 64, 128), (1, 2, 4), (4, 8), (2, 3, 4)),
    ),
    "chunks": (("CHUNKS", "NUM_WARPS", "NUM_STAGES"), ((None, 1, 2, 4, 8), (4, 8), (3, 4))),
}
LAYERS = 32  # calls per graph, each on its own layer's K/V (one layer's K/V at batch 16 would fit in the L2 cache)
# An attention path's arguments (`layer_inputs`): query, one layer's key and value pools, block tables, rows,
# positions, the additive mask of the keys up to the step's key length and the scale; (its output, None) back, as
# transformers' attention functions give it.
Attend = Callable[..., tuple[torch.Tensor, None]]


def graph_ms(calls: Sequence[Callable[[], object]], repeat: int = 20) -> float:
    """Median milliseconds per call of `calls`, replayed one after another in a CUDA graph."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[len(times) // 2]


def kernel_path(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, None]:
    """The Triton kernels through their operator, over the whole table (as a CUDA graph keyed by batch size has it)."""
    out = torch.ops.minedraft.paged_attention(query, key_cache, value_cache, block_tables, rows, positions, scale)
    return out, None


def gathered_path(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    matmuls: bool,
) -> tuple[torch.Tensor, None]:
    """Each row's keys up to the mask's length gathered through its table into `[B, kv_heads, keys, D]`, then SDPA
    (or two matmuls and a softmax in float32) with the queries sharing a K/V head stacked along the sequence axis."""
    batch, heads, n, dim = query.shape
    _, kv_heads, block_size, _ = key_cache.shape
    groups, keys = heads // kv_heads, mask.shape[-1]
    blocks = block_tables[rows, : keys // block_size].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        return cache[blocks].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, keys, dim)

    key, value = gather(key_cache), gather(value_cache)
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    stacked = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(batch, 1, groups * n, keys)
    if matmuls:
        scores = torch.matmul(folded, key.transpose(-1, -2)).float() * scale + stacked
        out = torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=stacked, scale=scale)
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous(), None


def path(name: str) -> Attend:
    """A path of PATHS, compiled."""
    attend: Attend = kernel_path if name == "kernel" else functools.partial(gathered_path, matmuls=name == "matmuls")
    return torch.compile(attend, fullgraph=True)


def layer_inputs(
    shape: tuple[int, int, int, int], batch: int, prefix: int, kv_len: int, max_len: int, block_size: int = 16
) -> list[Callable[[Attend], torch.Tensor]]:
    """Per layer, a call of an attention path (`Attend`) on: the query as projections leave it, the layer's pools (a
    stack's), block tables of `max_len` positions a row whose blocks lie scattered over the pool (entries past a
    row's end name block 0), rows out of order, positions (rows at random lengths from the prefix up to
    `kv_len`) and the additive mask of the keys up to `kv_len` (rounded up to whole blocks)."""
    heads, kv_heads, dim, n = shape
    width, keys = -(-max_len // block_size), -(-kv_len // block_size) * block_size
    lengths = prefix + torch.randint(0, kv_len - prefix - n + 1, (batch,), device="cuda")
    positions = lengths[:, None] + torch.arange(n, device="cuda")
    num_blocks = 1 + batch * width
    rows = torch.randperm(batch, device="cuda")  # entry b's keys in table row rows[b]
    tables = (1 + torch.randperm(num_blocks - 1, device="cuda")).view(batch, width)
    past = torch.arange(width, device="cuda")[None, :] * block_size > positions[:, -1:]  # entry b's blocks past its end
    block_tables = tables.masked_fill(past[rows.argsort()], 0).to(torch.int32)
    allowed = torch.arange(keys, device="cuda")[None, None, :] <= positions[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16, device="cuda")
    mask = mask.masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)[:, None]
    cache = torch.randn(LAYERS, 2, num_blocks, kv_heads, block_size, dim, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(batch, n, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)

    def call(layer: torch.Tensor, attend: Attend) -> torch.Tensor:
        return attend(query, layer[0], layer[1], block_tables, rows, positions, mask, dim**-0.5)[0]

    return [functools.partial(call, layer) for layer in cache]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--kv-len", type=int, default=768, help="keys of the longest row (the others past the prefix)")
    parser.add_argument("--max-len", type=int, default=1024, help="positions a block table's row holds")
    parser.add_argument("--block-size", type=int, default=16, help="positions a cache block holds")
    parser.add_argument(
        "--sweep",
        nargs="?",
        const="tiles",
        choices=tuple(SWEEPS),
        help="time the kernels' parameters instead of the three paths: tiles (decode_attention's "
        "BLOCK_KEYS, PROGRAMS_PER_SM, NUM_WARPS, NUM_STAGES) or chunks (CHUNKS, NUM_WARPS, "
        "NUM_STAGES)",
    )
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
        return
    torch.manual_seed(0)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per layer, compiled, {LAYERS} layers in a "
        f"CUDA graph; prefix {args.prefix}, keys read up to {args.kv_len} of {args.max_len}, blocks of "
        f"{args.block_size}; max diff against the matmuls"
    )
    print(
        f"{'shape':12s} {'B':>3s} {'K/V MB':>7s} {'floor us':>8s} {'kernel':>7s} {'fused':>7s} {'matmuls':>7s} "
        f"{'max diff':>9s}"
    )
    for name in args.shapes.split(","):
        _, kv_heads, dim, _ = SHAPES[name]
        for batch in (int(b) for b in args.batches.split(",")):
            layers = layer_inputs(SHAPES[name], batch, args.prefix, args.kv_len, args.max_len, args.block_size)
            kv_bytes = 2 * batch * kv_heads * args.prefix * dim * 2  # bf16 K and V up to the prefix
            floor_us = kv_bytes / 4.2e12 * 1e6  # an H200's measured copy bandwidth
            times, outputs = {}, {}
            for attend in PATHS:
                torch._dynamo.reset()
                layer = path(attend)
                times[attend] = graph_ms([functools.partial(call, layer) for call in layers]) * 1e3
                outputs[attend] = layers[0](layer).float()
            cells = " ".join(f"{times[p]:7.1f}" for p in PATHS)
            diff = max((outputs[p] - outputs["matmuls"]).abs().max().item() for p in PATHS)
            print(f"{name:12s} {batch:3d} {kv_bytes / 1e6:7.1f} {floor_us:8.1f} {cells} {diff:9.2e}", flush=True)
            del layers


def sweep(args: argparse.Namespace) -> None:
    """The kernel path alone, over its parameters: us per layer of every setting, best first (defaults marked *)."""
    kernels = decode_attention
    names, values = SWEEPS[args.sweep]
    defaults = tuple(getattr(kernels, name) for name in names)  # None: chosen per step (`decode_attention.tiles`)
    settings = [defaults, *(s for s in itertools.product(*values) if s != defaults)]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the kernels' us per layer over "
        f"{'/'.join(names)}; prefix {args.prefix}, keys read up to {args.kv_len} of {args.max_len}, blocks of "
        f"{args.block_size}; default {defaults} marked *"
    )
    # The kernels are opaque to the compiler: one compile serves every setting.
    layer = path("kernel")
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            layers = layer_inputs(SHAPES[name], batch, args.prefix, args.kv_len, args.max_len, args.block_size)
            reference = layers[0](layer).float()
            times = {}
            for setting in settings:
                for attribute, value in zip(names, setting):
                    setattr(kernels, attribute, value)
                times[setting] = graph_ms([functools.partial(call, layer) for call in layers]) * 1e3
                assert (layers[0](layer).float() - reference).abs().max().item() < 0.05, setting
            for attribute, value in zip(names, defaults):
                setattr(kernels, attribute, value)
            ranked = sorted(times, key=times.__getitem__)
            cells = " ".join(f"{s}:{times[s]:.1f}{'*' if s == defaults else ''}" for s in ranked)
            print(f"{name:12s} {batch:3d} default {times[defaults]:6.1f}  best first: {cells}", flush=True)
            del layers


if __name__ == "__main__":
    main()
