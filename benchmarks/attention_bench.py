"""The step attention's paths alone on the GPU, compiled, at real steps' shapes.

The paths: the Triton kernels, fused SDPA and two matmuls.

A layer's attention alone does not predict a whole step's: choose paths by whole-step
A/Bs (`benchmarks/gpu_run.sh ab compile`) and use this to see where the paths stand against the K/V floor.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from collections.abc import Callable
from types import SimpleNamespace

import torch

import minedraft.engine.attention as attention

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


def graph_ms(calls: list[Callable[[], object]], repeat: int = 20) -> float:
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


def layer_inputs(
    shape: tuple[int, int, int, int], batch: int, prefix: int, kv_len: int, max_len: int
) -> list[Callable[[Callable[..., tuple[torch.Tensor, None]]], torch.Tensor]]:
    """Per layer, a call of an attention function on: a module stub, the query as projections leave it, K/V as
    views of a block of the layer's cache rows, the step's additive mask (rows at random lengths past the prefix)
    and its positions, as the decoder layers pass them on from the model runner (which says the mask is causal by
    those positions)."""
    heads, kv_heads, dim, n = shape
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads)
    lengths = prefix + torch.randint(0, kv_len - prefix - n + 1, (batch,), device="cuda")
    positions = lengths[:, None] + torch.arange(n, device="cuda")
    allowed = torch.arange(kv_len, device="cuda")[None, None, :] <= positions[:, :, None]
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16, device="cuda")
    mask = mask.masked_fill_(~allowed, torch.finfo(torch.bfloat16).min)[:, None]
    cache = torch.randn(LAYERS, 2, batch + 1, kv_heads, max_len, dim, dtype=torch.bfloat16, device="cuda")
    query = torch.randn(batch, n, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)

    def call(layer: torch.Tensor, attend: Callable[..., tuple[torch.Tensor, None]]) -> torch.Tensor:
        return attend(
            module,
            query,
            layer[0, :batch, :, :kv_len],
            layer[1, :batch, :, :kv_len],
            mask,
            position_ids=positions,
            **{attention.CAUSAL_BY_POSITIONS: True},
        )[0]

    return [functools.partial(call, layer) for layer in cache]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,8,16,32,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--kv-len", type=int, default=768, help="keys read, a multiple of the cache's KV bucket")
    parser.add_argument("--max-len", type=int, default=1024)
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
        f"CUDA graph; prefix {args.prefix}, keys read {args.kv_len}; the path a step takes marked *; max diff "
        "against the matmuls"
    )
    print(
        f"{'shape':12s} {'B':>3s} {'K/V MB':>7s} {'floor us':>8s} {'kernel':>7s} {'fused':>7s} {'matmuls':>7s} "
        f"{'max diff':>9s}"
    )
    kernels, chosen = attention.KERNELS, attention.takes_matmuls
    for name in args.shapes.split(","):
        heads, kv_heads, _, n = SHAPES[name]
        for batch in (int(b) for b in args.batches.split(",")):
            layers = layer_inputs(SHAPES[name], batch, args.prefix, args.kv_len, args.max_len)
            kv_bytes = 2 * batch * kv_heads * args.prefix * SHAPES[name][2] * 2  # bf16 K and V up to the prefix
            floor_us = kv_bytes / 4.2e12 * 1e6  # an H200's measured copy bandwidth
            times, outputs = {}, {}
            for path in PATHS:
                # The kernels run whenever KERNELS is set; without them takes_matmuls() picks the other two.
                attention.KERNELS = kernels if path == "kernel" else None
                attention.takes_matmuls = lambda *_, matmuls=path == "matmuls": matmuls  # type: ignore[misc]
                torch._dynamo.reset()
                layer: Callable[..., tuple[torch.Tensor, None]] = torch.compile(
                    attention.grouped_sdpa_attention, fullgraph=True
                )
                times[path] = graph_ms([functools.partial(call, layer) for call in layers]) * 1e3
                outputs[path] = layers[0](layer).float()
            attention.KERNELS, attention.takes_matmuls = kernels, chosen
            picked = (
                "kernel"
                if kernels is not None
                else "matmuls"
                if chosen(batch, kv_heads, heads // kv_heads * n)
                else "fused"
            )
            cells = " ".join(f"{times[p]:6.1f}{'*' if p == picked else ' '}" for p in PATHS)
            diff = max((outputs[p] - outputs["matmuls"]).abs().max().item() for p in PATHS)
            print(f"{name:12s} {batch:3d} {kv_bytes / 1e6:7.1f} {floor_us:8.1f} {cells} {diff:9.2e}", flush=True)
            del layers


def sweep(args: argparse.Namespace) -> None:
    """The kernel path alone, over its parameters: us per layer of every setting, best first (defaults marked *)."""
    from minedraft.kernels import decode_attention as kernels

    names, values = SWEEPS[args.sweep]
    defaults = tuple(getattr(kernels, name) for name in names)  # None: chosen per step (`decode_attention.tiles`)
    settings = [defaults, *(s for s in itertools.product(*values) if s != defaults)]
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; the kernels' us per layer over "
        f"{'/'.join(names)}; prefix {args.prefix}, keys read {args.kv_len}; default {defaults} marked *"
    )
    # The kernels are opaque to the compiler: one compile serves every setting.
    layer: Callable[..., tuple[torch.Tensor, None]] = torch.compile(attention.grouped_sdpa_attention, fullgraph=True)
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            layers = layer_inputs(SHAPES[name], batch, args.prefix, args.kv_len, args.max_len)
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
