"""The rotary-and-write kernel gives the same bits as transformers' rotary embedding and a block-table cache write.

On the CPU through Triton's interpreter, and on GPUs."""

from __future__ import annotations

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed")

# (batch, new tokens, query heads, K/V heads, head dim, block size): a verify with GQA, a decode without, a
# prefill-sized step over several blocks, a head size that is no power of two; blocks of 16 positions and of 12.
SHAPES = [(3, 5, 8, 2, 32, 16), (2, 1, 4, 4, 16, 12), (1, 37, 4, 2, 64, 16), (2, 3, 6, 2, 40, 12)]


def reference(
    projections: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """transformers' rotary embedding, as the engine's fallback applies it, and a write through the block table."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    batch, queries = projections.shape[:2]
    dim, size = key_cache.shape[-1], key_cache.shape[2]
    query, key, value = projections.view(batch, queries, -1, dim).split([heads, kv_heads, kv_heads], dim=2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)  # [B, n, heads, D] as they come
    blocks = block_tables[rows[:, None], positions // size].long()
    key_cache[blocks, :, positions % size] = key  # key_cache[block of (b, i), :, offset of (b, i)] = key[b, i]
    value_cache[blocks, :, positions % size] = value
    return query.contiguous()


def check_against_reference(device: str, dtype: torch.dtype) -> None:
    """Each case: the kernel's queries and both whole pool stacks equal the reference's, bit for bit (table rows out
    of order, each row's blocks scattered over the pool out of order, positions past other rows' ends and across
    blocks; cos/sin per row, or one row broadcast)."""
    from minedraft.kernels import rotary_write

    generator = torch.Generator().manual_seed(0)
    for (batch, n, heads, kv_heads, dim, size), shared_angles in zip(SHAPES, (False, False, True, False), strict=True):

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device, dtype)

        projections = randn(batch, n, (heads + 2 * kv_heads) * dim)
        angles = torch.rand(1 if shared_angles else batch, n, dim // 2, generator=generator) * 50
        angles = torch.cat([angles, angles], dim=-1)  # as transformers' rotary embedding makes them
        cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
        table_rows, width = batch + 2, -(-(n + 20) // size)
        layers, num_blocks = 3, table_rows * width + 1
        stacks = [randn(layers, num_blocks, kv_heads, size, dim) for _ in range(2)]
        # Distinct blocks for every table entry, so that no two tokens write one place.
        tables = torch.randperm(num_blocks, generator=generator)[: table_rows * width].view(table_rows, width)
        block_tables = torch.cat([tables, tables], 1).to(device, torch.int32)[:, :width]  # a view of a wider table
        rows = torch.randperm(table_rows, generator=generator)[:batch].to(device)
        starts = torch.randint(0, width * size - n + 1, (batch, 1), generator=generator)
        positions = (starts + torch.arange(n)).to(device)
        got, want = [s.clone() for s in stacks], [s.clone() for s in stacks]
        query = rotary_write.rotate_and_write(
            projections, cos, sin, got[0][1], got[1][1], block_tables, rows, positions, heads, kv_heads
        )
        expected = reference(
            projections, cos, sin, want[0][1], want[1][1], block_tables, rows, positions, heads, kv_heads
        )
        case = (batch, n, heads, kv_heads, dim, size, dtype)
        assert query.shape == (batch, n, heads, dim) and torch.equal(query, expected), case
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), case
        assert not torch.equal(got[0], stacks[0]) and not torch.equal(got[1], stacks[1]), case  # something was written


@needs_interpreter
def test_the_kernel_equals_the_reference_in_triton_interpreter() -> None:
    run_in_interpreter("test_rotary_write", "t.check_against_reference('cpu', torch.float32)")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_equals_the_reference_on_a_gpu() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_against_reference("cuda", dtype)


def test_the_operator_refuses_a_cache_of_other_heads() -> None:
    from minedraft.engine.kv_cache import rotate_and_write

    stacks = torch.zeros(2, 1, 3, 4, 16, 16)  # (K, V) x [layers, blocks, kv_heads, block_size, head_dim]
    with pytest.raises(ValueError, match="2 K/V heads"):
        rotate_and_write(
            torch.zeros(1, 1, 8 * 16),
            torch.ones(1, 1, 16),
            torch.zeros(1, 1, 16),
            stacks[0],
            stacks[1],
            0,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            4,
            2,
        )
