"""The end of an 8B verify on the GPU, each way inside a CUDA graph: the LM head's GEMM and the greedy argmax."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, ".")
from benchmarks.attention_bench import graph_ms  # noqa: E402
from minedraft.engine.sampling import greedy_tokens  # noqa: E402
from minedraft.kernels.argmax import chunked_argmax  # noqa: E402

HIDDEN, VOCAB = 4096, 128256


def graph_time(fn: Callable[[], object], blas: str = "cublaslt") -> float:
    """Median us of one call of `fn`, 20 calls replayed in a CUDA graph (`attention_bench.graph_ms`), its GEMMs from
    `blas`."""
    library = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(blas)
    try:
        return graph_ms([fn] * 20) * 1e3
    finally:
        torch.backends.cuda.preferred_blas_library(library)


def measure(
    rows: int,
    weight: torch.Tensor,
    padded: torch.Tensor,
    compiled: Callable[..., torch.Tensor],
    compiled_op: Callable[..., torch.Tensor],
) -> None:
    """Each way of the LM head, then each way of the argmax, at `rows` hidden states."""
    floor_us = weight.numel() * 2 / 4.64e6  # bytes at the 4.64 TB/s that gemm_bench's fit gives
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    halves, quarters = weight.chunk(2), weight.chunk(4)
    heads: dict[str, tuple[Callable[[], object], str]] = {
        "cuBLASLt": (lambda: torch.nn.functional.linear(x, weight), "cublaslt"),
        "cuBLAS": (lambda: torch.nn.functional.linear(x, weight), "cublas"),
        "cuBLASLt, 2 GEMMs": (lambda: [torch.nn.functional.linear(x, w) for w in halves], "cublaslt"),
        "cuBLASLt, 4 GEMMs": (lambda: [torch.nn.functional.linear(x, w) for w in quarters], "cublaslt"),
        "cuBLASLt, vocab padded to 1024s": (lambda: torch.nn.functional.linear(x, padded), "cublaslt"),
        "cuBLASLt, transposed (W x^T)": (lambda: torch.mm(weight, x.t()), "cublaslt"),
        "cuBLAS, transposed (W x^T)": (lambda: torch.mm(weight, x.t()), "cublas"),
    }
    for name, (fn, blas) in heads.items():
        us = graph_time(fn, blas)
        print(f"rows={rows} LM head {name}: {us:.1f} us ({floor_us / us:.2f} of 4.64 TB/s)", flush=True)
    logits = torch.nn.functional.linear(x, weight)
    expected = logits.argmax(-1)
    argmaxes: dict[str, Callable[[], torch.Tensor]] = {
        "argmax": lambda: logits.argmax(-1),
        "greedy_tokens": lambda: greedy_tokens(logits),
        "greedy_tokens compiled": lambda: compiled(logits),
        "chunked_argmax (Triton)": lambda: chunked_argmax(logits),
        "chunked_argmax (Triton), compiled caller": lambda: compiled_op(logits),
    }
    for name, fn in argmaxes.items():
        assert torch.equal(fn(), expected), name
        us = graph_time(fn)
        print(f"rows={rows} argmax {name}: {us:.1f} us ({logits.numel() * 2 / us / 1e6:.2f} TB/s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="5,40,80", help="rows of hidden states (batch x (k + 1))")
    args = parser.parse_args()
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    padded = torch.nn.functional.pad(weight, (0, 0, 0, -VOCAB % 1024))
    compiled = torch.compile(greedy_tokens, dynamic=True)
    compiled_op = torch.compile(lambda t: chunked_argmax(t) + 0, dynamic=True)
    for rows in (int(r) for r in args.rows.split(",")):
        measure(rows, weight, padded, compiled, compiled_op)


if __name__ == "__main__":
    main()
