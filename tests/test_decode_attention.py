"""The Triton paged attention equals float64 attention: on the CPU through Triton's interpreter, and on GPUs."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

triton = pytest.importorskip("triton", reason="Triton is not installed")


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    kv_heads: int
    n: int  # new tokens
    dim: int
    keys: int  # the longest row's
    block_size: int
    window: int
    chunks: int | None
    block_keys: int
    max_rows: int | None = None  # `decode_attention.MAX_ROWS`: folded queries a program takes


# GQA verify and decode shapes, no GQA; one chunk, several, more chunks than tiles; both tiles that steps choose between
# (`decode_attention.tiles`); blocks of 16 and 12 positions; sliding windows shorter than the rows; a head size that is
# no power of two; folded queries in slices (one chunk and several, with a window), the last slice part padding.
CASES = [
    Case(3, 8, 2, 5, 32, 200, 16, 0, None, 64),
    Case(3, 8, 2, 5, 32, 300, 12, 0, 3, 128),
    Case(1, 4, 1, 1, 16, 130, 16, 0, 1, 128),
    Case(4, 4, 4, 1, 16, 70, 12, 0, 8, 64),
    Case(3, 12, 2, 3, 64, 260, 16, 40, 2, 128),
    Case(3, 4, 2, 4, 40, 150, 12, 24, 4, 64),
    Case(3, 6, 2, 2, 80, 100, 16, 0, 3, 64),
    Case(3, 8, 2, 9, 32, 200, 16, 0, 1, 64, max_rows=16),
    Case(3, 12, 2, 3, 64, 260, 16, 40, 2, 128, max_rows=16),
    Case(2, 8, 2, 5, 32, 150, 12, 0, None, 64, max_rows=16),
]


@dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor


def paged_inputs(case: Case, device: str, dtype: torch.dtype, generator: torch.Generator) -> Inputs:
    """Random inputs for `case`: each entry's last `n` positions are its queries, entry 0 with only its own new
    tokens (every later tile and chunk empty), another as long as `case.keys`. Entries take a subset of the table's
    rows out of order; each row's blocks are scattered over the pool out of order, two rows share their first block,
    and the table's entries past a row's end name the NaN-filled trash block 0 or any block. Every cache entry that no
    query may read is NaN (past a row's last position, and before its first query's window), as garbage might be;
    the pools are views of layer stacks, with strides of their own."""
    batch, kv_heads, dim, size = case.batch, case.kv_heads, case.dim, case.block_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, dtype)

    # As the projections leave it ([B, n, heads, D] transposed), or contiguous.
    query = (
        randn(batch, case.n, case.heads, dim).transpose(1, 2) if case.n > 1 else randn(batch, case.heads, case.n, dim)
    )
    lengths = torch.randint(max(case.n, size + 1), case.keys + 1, (batch,), generator=generator)
    lengths[0], lengths[-1] = case.n, case.keys
    positions = lengths[:, None] - case.n + torch.arange(case.n)
    table_rows, width = batch + 3, -(-case.keys // size) + 2  # more table rows and entries than used
    used = -(-lengths // size)
    num_blocks = 1 + batch * width  # more blocks than used, never written
    blocks = (1 + torch.randperm(num_blocks - 1, generator=generator))[: int(used.sum())].split(used.tolist())
    tables = torch.randint(0, num_blocks, (table_rows, width), generator=generator)
    tables[:, ::2] = 0  # the trash block
    rows = torch.randperm(table_rows, generator=generator)[:batch]
    for row, own in zip(rows.tolist(), blocks, strict=True):
        tables[row, : len(own)] = own
    if batch > 2:
        tables[rows[2], 0] = tables[rows[1], 0]  # a shared first block (both rows have more than one block's keys)
    # Layer 1 of a stack of two, keys and values strided alike (as the cache's stacks): heads outermost, positions
    # padded.
    nan = float("nan")
    stack = torch.full((2, 2, kv_heads, num_blocks, size + 3, dim), nan, dtype=dtype, device=device)
    key_cache, value_cache = stack[:, 1].transpose(1, 2)[:, :, :, :size].unbind(0)
    for b, row in enumerate(rows.tolist()):
        first = max(int(positions[b].min()) - case.window + 1, 0) if case.window else 0
        for position in range(first, int(lengths[b])):
            block, offset = int(tables[row, position // size]), position % size
            key_cache[block, :, offset] = randn(kv_heads, dim)
            value_cache[block, :, offset] = randn(kv_heads, dim)
    # A view too, of a wider table.
    block_tables = torch.cat([tables, tables[:, :5]], 1).to(device, torch.int32)[:, :width]
    return Inputs(query, key_cache, value_cache, block_tables, rows.to(device), positions.to(device))


def reference(inputs: Inputs, scale: float, window: int) -> torch.Tensor:
    """[B, n, heads, D] in float64: each entry's keys gathered through its table row, a softmax over the keys up to
    each query's position (and within the window)."""
    query, tables, size = inputs.query.cpu().double(), inputs.block_tables.cpu().long(), inputs.key_cache.shape[2]
    groups = query.shape[1] // inputs.key_cache.shape[1]
    out = []
    for b, row in enumerate(inputs.rows.tolist()):
        positions = inputs.positions[b].cpu()
        length = torch.arange(int(positions.max()) + 1)
        blocks, offsets = tables[row, length // size], length % size
        k, v = (
            cache.cpu().double()[blocks, :, offsets].nan_to_num().transpose(0, 1)
            for cache in (inputs.key_cache, inputs.value_cache)
        )
        allowed = length[None, :] <= positions[:, None]
        if window:
            allowed &= length[None, :] > positions[:, None] - window
        scores = query[b] @ k.repeat_interleave(groups, 0).transpose(-1, -2) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ v.repeat_interleave(groups, 0)).transpose(0, 1))
    return torch.stack(out)


def check_against_reference(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """Each of CASES, through the operator (what compiled layers call) where it takes the chunks chosen per step."""
    from minedraft.kernels import decode_attention
    from minedraft.kernels.decode_attention import paged_attention

    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for case in CASES:
        inputs = paged_inputs(case, device, dtype, generator)
        scale = case.dim**-0.5
        decode_attention.BLOCK_KEYS, decode_attention.MAX_ROWS = case.block_keys, case.max_rows
        try:
            args = (inputs.query, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.rows)
            if case.chunks is None:
                out = torch.ops.minedraft.paged_attention(*args, inputs.positions, scale, case.window)
            else:
                out = paged_attention(*args, inputs.positions, scale, case.window, case.chunks)
        finally:
            decode_attention.BLOCK_KEYS, decode_attention.MAX_ROWS = None, None
        expected = reference(inputs, scale, case.window)
        fixed = paged_attention(*args, inputs.positions, scale, case.window, fixed=True)  # (`--deterministic`)
        for result in (out, fixed):
            assert result.shape == (case.batch, case.n, case.heads, case.dim), case
            assert torch.isfinite(result).all(), f"non-finite output for {case}"
            error = ((result.cpu().double() - expected).norm() / expected.norm()).item()
            assert error < tolerance, f"relative error {error:.2e} for {case}"


def check_ragged_against_reference(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """A ragged step (TETRIS's verify): each row of a case only its first counts[b] queries (0 and n among them),
    flattened row after row with padding tokens after them, equals the padded step's reference for those queries,
    whole or in slices of 16 folded queries, split into chunks or not, and `fixed`."""
    from minedraft.kernels import decode_attention
    from minedraft.kernels.decode_attention import paged_attention

    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for case in [c for c in CASES if c.n > 1]:
        inputs = paged_inputs(case, device, dtype, generator)
        counts = torch.randint(0, case.n + 1, (case.batch,), generator=generator)
        counts[0], counts[-1] = case.n, 0
        begins = counts.cumsum(0) - counts
        padded = inputs.query.transpose(1, 2)  # [B, n, heads, D]
        flat = torch.cat([padded[b, : int(c)] for b, c in enumerate(counts)] + [padded[0, :2]])
        expected = reference(inputs, case.dim**-0.5, case.window)
        wanted = torch.cat([expected[b, : int(c)] for b, c in enumerate(counts)])
        args = (flat, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.rows, inputs.positions)
        ragged = (begins.to(device), counts.to(device))
        for rows_each, chunks, fixed in ((None, case.chunks, False), (16, 2, False), (None, None, True)):
            decode_attention.RAGGED_ROWS = rows_each
            try:
                if chunks is None:  # (through the operator, which chooses the chunks per step)
                    out = torch.ops.minedraft.paged_attention(*args, case.dim**-0.5, case.window, fixed, *ragged)
                else:
                    out = paged_attention(*args, case.dim**-0.5, case.window, chunks, fixed, *ragged)
            finally:
                decode_attention.RAGGED_ROWS = None
            assert out.shape == flat.shape, case
            error = ((out[: len(wanted)].cpu().double() - wanted).norm() / wanted.norm()).item()
            assert error < tolerance, f"relative error {error:.2e} for {case} (rows {rows_each}, chunks {chunks})"


@needs_interpreter
def test_the_kernels_equal_float64_attention_in_triton_interpreter() -> None:
    run_in_interpreter("test_decode_attention", "t.check_against_reference('cpu', torch.float32, 1e-5)")


@needs_interpreter
def test_ragged_steps_equal_float64_attention_in_triton_interpreter() -> None:
    run_in_interpreter("test_decode_attention", "t.check_ragged_against_reference('cpu', torch.float32, 1e-5)")


def check_in_a_cuda_graph(device: str) -> None:
    """Captured once, a call replays right for other rows, lengths and tables of the same shapes: nothing on the host
    depends on them (chunks chosen per step, by the shapes alone)."""
    from minedraft.kernels.decode_attention import paged_attention

    generator = torch.Generator().manual_seed(0)
    case = Case(4, 8, 2, 5, 64, 300, 16, 0, None, 64)
    first, second = (paged_inputs(case, device, torch.bfloat16, generator) for _ in range(2))
    second.rows[:] = second.rows.flip(0)  # entry 0, whose row was the shortest, now the longest
    second.positions[:] = second.positions.flip(0)
    static = Inputs(*(t.clone() for t in vars(first).values()))

    def call() -> torch.Tensor:
        return paged_attention(
            static.query,
            static.key_cache,
            static.value_cache,
            static.block_tables,
            static.rows,
            static.positions,
            0.125,
        )

    call()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for inputs in (second, first):
        for name, tensor in vars(inputs).items():
            getattr(static, name).copy_(tensor)
        graph.replay()
        expected = reference(inputs, 0.125, 0)
        error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
        assert error < 2e-2, error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernels_equal_float64_attention_on_a_gpu() -> None:
    """On each GPU (the kernels must launch on their tensors' GPU, whichever is current)."""
    for index in range(torch.cuda.device_count()):
        check_against_reference(f"cuda:{index}", torch.float32, 1e-5)
        check_against_reference(f"cuda:{index}", torch.bfloat16, 2e-2)
        check_ragged_against_reference(f"cuda:{index}", torch.bfloat16, 2e-2)
        with torch.cuda.device(index):
            check_in_a_cuda_graph(f"cuda:{index}")


def test_the_kernels_take_only_the_shapes_they_handle() -> None:
    """Head sizes of 16 or more, one size and one pool shape for K and V, unit last strides, whole GQA groups."""
    from minedraft.kernels.decode_attention import supports

    def inputs(dim: int = 64, value_dim: int = 64, heads: int = 8) -> list[torch.Tensor]:
        return [torch.randn(2, heads, 5, dim), torch.randn(9, 2, 16, dim), torch.randn(9, 2, 16, value_dim)]

    assert supports(*inputs())
    assert supports(*inputs(dim=80, value_dim=80))  # padded to 128
    assert not supports(*inputs(dim=8, value_dim=8))
    assert not supports(*inputs(value_dim=32))
    assert not supports(*inputs(heads=5))
    query, key, value = inputs()
    assert not supports(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value)
    assert not supports(query, key, torch.randn(9, 2, 12, 64))  # other blocks for the values
    assert not supports(query, key[0], value[0])  # a slot cache's row, not a pool
