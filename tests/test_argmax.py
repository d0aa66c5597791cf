"""The chunked argmax kernels give `torch.argmax`'s index, ties to the first: on the CPU through Triton's interpreter,
and on GPUs."""

from __future__ import annotations

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed")


def check_against_torch(device: str) -> None:
    """Rows of several vocabulary sizes (one chunk, several, a partial last one), in bf16 and float32: random, with
    the maximum repeated across chunks and within one, all equal, all -inf, and NaNs (the first NaN's index, as
    torch gives; a +inf before a NaN is not: the kernels count a NaN as +inf)."""
    from minedraft.kernels.argmax import CHUNK, chunked_argmax

    generator = torch.Generator().manual_seed(0)
    for vocab in (100, CHUNK, 3 * CHUNK + 17):
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(2, 5, vocab, generator=generator).to(dtype)
            logits[0, 1, [7, vocab - 1]] = 9.0  # the same maximum twice, chunks apart when there are several
            logits[0, 2, [vocab - 3, vocab - 2]] = 9.0  # twice in one chunk
            logits[1, 0] = 1.0
            logits[1, 1] = float("-inf")
            logits[1, 2, [5, vocab - 2]] = float("nan")  # two NaNs, chunks apart when there are several
            logits[1, 3, vocab - 1] = float("nan")  # in the last chunk only, after the row's maximum
            logits[1, 4, :] = float("nan")
            logits = logits.to(device)
            got = chunked_argmax(logits)
            assert got.dtype == torch.long and got.shape == (2, 5)
            assert torch.equal(got, logits.argmax(-1)), (vocab, dtype, got, logits.argmax(-1))


@needs_interpreter
def test_the_kernels_equal_torch_argmax_in_triton_interpreter() -> None:
    run_in_interpreter("test_argmax", "t.check_against_torch('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernels_equal_torch_argmax_on_a_gpu() -> None:
    check_against_torch("cuda")
