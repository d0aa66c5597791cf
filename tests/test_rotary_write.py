"""The rotary-and-write kernel gives the same bits as transformers' rotary embedding and an indexed cache write.

On the CPU through Triton's interpreter, and on GPUs."""

from __future__ import annotations

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed")

# (batch, new tokens, query heads, K/V heads, head dim): a verify with GQA, a decode without, a prefill-sized step,
# a head size that is no power of two.
SHAPES = [(3, 5, 8, 2, 32), (2, 1, 4, 4, 16), (1, 37, 4, 2, 64), (2, 3, 6, 2, 40)]


def check_against_reference(device: str, dtype: torch.dtype) -> None:
    """Each case: the kernel's queries and both whole cache stacks equal the operator's reference code's, bit for bit
    (rows out of order, positions past other rows' ends; cos/sin per row, or one row broadcast)."""
    from minedraft.engine import kv_cache
    from minedraft.kernels import rotary_write

    generator = torch.Generator().manual_seed(0)
    for (batch, n, heads, kv_heads, dim), shared_angles in zip(SHAPES, (False, False, True, False), strict=True):

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device, dtype)

        projections = randn(batch, n, (heads + 2 * kv_heads) * dim)
        angles = torch.rand(1 if shared_angles else batch, n, dim // 2, generator=generator) * 50
        angles = torch.cat([angles, angles], dim=-1)  # as transformers' rotary embedding makes them
        cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        layers, cache_rows, length = 3, batch + 2, n + 20
        stacks = [randn(layers, cache_rows, kv_heads, length, dim) for _ in range(2)]
        rows = torch.randperm(cache_rows, generator=generator)[:batch].to(device)
        positions = (torch.randint(0, length - n + 1, (batch, 1), generator=generator) + torch.arange(n)).to(device)
        got, want = [s.clone() for s in stacks], [s.clone() for s in stacks]
        query = rotary_write.rotate_and_write(
            projections, cos, sin, got[0][1], got[1][1], rows, positions, heads, kv_heads
        )
        kernel, kv_cache.ROTARY_KERNEL = kv_cache.ROTARY_KERNEL, None
        try:
            expected = kv_cache.rotate_and_write(
                projections, cos, sin, want[0], want[1], 1, rows, positions, heads, kv_heads
            )
        finally:
            kv_cache.ROTARY_KERNEL = kernel
        case = (batch, n, heads, kv_heads, dim, dtype)
        assert query.shape == (batch, n, heads, dim) and torch.equal(query, expected), case
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case
        assert not torch.equal(got[0], stacks[0]), case  # something was written


@needs_interpreter
def test_the_kernel_equals_the_reference_in_triton_interpreter() -> None:
    run_in_interpreter("test_rotary_write", "t.check_against_reference('cpu', torch.float32)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_equals_the_reference_on_a_gpu() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_against_reference("cuda", dtype)


def test_the_operator_refuses_a_cache_of_other_heads() -> None:
    from minedraft.engine.kv_cache import rotate_and_write

    stacks = torch.zeros(2, 1, 3, 4, 8, 16)
    with pytest.raises(ValueError, match="2 K/V heads"):
        rotate_and_write(
            torch.zeros(1, 1, 8 * 16),
            torch.ones(1, 1, 16),
            torch.zeros(1, 1, 16),
            stacks[0],
            stacks[1],
            0,
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            4,
            2,
        )
