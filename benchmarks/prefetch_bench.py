"""The 8B verify's attention and output projection, with and without the projection's weight prefetched into L2.

At a verify's 40-80 rows cuBLASLt runs the output projection (4096 x 4096) on 64 thread blocks, each bound by
what one SM can pull from memory (15.9 us a layer, 2.1 TB/s), while the attention before it leaves memory
bandwidth unused. `prefetch` asks L2 for the weight from a side stream as the attention starts. Each figure: us per
layer, 32 layers (each its own K/V and weight) replayed in a CUDA graph. Run 22e: the projection read from L2 was
still 12 us, and the prefetch slowed the attention beside it by more (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, ".")
from benchmarks.attention_bench import SHAPES, graph_ms, layer_inputs  # noqa: E402
from minedraft.engine import attention  # noqa: E402

LINE = 128  # bytes an L2 prefetch brings in
LINES_PER_PROGRAM = 1024


@triton.jit
def _prefetch_kernel(ptr, last_byte, LINES: tl.constexpr, LINE_BYTES: tl.constexpr):
    """Program: one L2 prefetch per line, kept in L2 ahead of streamed data (evict_last); nothing is read into the
    SM (yet the kernel lasts as long as a read of the whole tensor would: 8 us for 33.5 MB)."""
    offsets = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE_BYTES
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptr + tl.minimum(offsets, last_byte)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def prefetch(tensor: torch.Tensor) -> None:
    """Ask the L2 cache for every line of the contiguous `tensor` on the current stream."""
    data = tensor.view(-1).view(torch.uint8)
    lines = triton.cdiv(data.numel(), LINE)
    with torch.cuda.device(tensor.device):
        _prefetch_kernel[(triton.cdiv(lines, LINES_PER_PROGRAM),)](
            data, data.numel() - 1, LINES=LINES_PER_PROGRAM, LINE_BYTES=LINE, num_warps=8
        )


def measure(batch: int, layer: Callable[..., tuple[torch.Tensor, None]], side: torch.cuda.Stream) -> list[float]:
    """ms per layer: attention, output projection, both, both with the weight prefetched, the projection right
    after its own prefetch, the prefetch alone."""
    heads, _, dim, n = SHAPES["8b-verify"]
    rows, hidden = batch * n, heads * dim
    attend = layer_inputs(SHAPES["8b-verify"], batch, 512, 768, 1024)
    weights = [torch.randn(hidden, hidden, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in attend]
    residual = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def project(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.addmm(residual, a.reshape(rows, hidden), w.t())

    def both(call: Callable[..., torch.Tensor], w: torch.Tensor, ahead: bool) -> torch.Tensor:
        if ahead:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prefetch(w)
        out = call(layer)
        if ahead:
            torch.cuda.current_stream().wait_stream(side)
        return project(out, w)

    def after_prefetch(w: torch.Tensor) -> torch.Tensor:
        prefetch(w)
        return project(x, w)

    pairs = list(zip(attend, weights, strict=True))
    return [
        graph_ms([functools.partial(call, layer) for call in attend]),
        graph_ms([functools.partial(project, x, w) for w in weights]),
        graph_ms([functools.partial(both, call, w, False) for call, w in pairs]),
        graph_ms([functools.partial(both, call, w, True) for call, w in pairs]),
        graph_ms([functools.partial(after_prefetch, w) for w in weights]),
        graph_ms([functools.partial(prefetch, w) for w in weights]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="8,16")
    args = parser.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    side = torch.cuda.Stream()
    layer: Callable[..., tuple[torch.Tensor, None]] = torch.compile(attention.grouped_sdpa_attention, fullgraph=True)
    columns = ("attention", "o_proj", "both", "both, o prefetched", "o after its prefetch", "prefetch")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us per layer, 32 layers in a CUDA graph")
    print(f"{'B':>3} " + " ".join(columns))
    for batch in (int(b) for b in args.batches.split(",")):
        cells = measure(batch, layer, side)
        print(
            f"{batch:3d} " + " ".join(f"{ms * 1e3:{len(c)}.1f}" for ms, c in zip(cells, columns, strict=True)),
            flush=True,
        )
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
