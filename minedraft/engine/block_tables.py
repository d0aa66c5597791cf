"""Block tables of a paged KV cache: each sequence row's blocks on the host, its table and length on the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from minedraft.engine.block_pool import TRASH_BLOCK, BlockPool, block_hashes
from minedraft.engine.cuda_graphs import capture_graph
from minedraft.errors import CapacityError

# Cells of table storage before the tables: cell 0 takes empty table writes; four keep the tables 16-byte aligned.
TABLE_START = 4


class TableWriter:
    """Table entries from the host written on CUDA by a copy and one graph's launch. Eagerly, a pinned tensor made,
    moved and scattered cost an H200's host ~200 us a flush at batch 64 (benchmarks/profile_step.py). The entries go
    into pinned buffers in turn; each is refilled only once the copy that read it last has run."""

    ENTRIES = 256  # at most, a write (padded with empty entries: cell 0)
    BUFFERS = 4

    def __init__(self, apply_writes: Callable[[torch.Tensor], None], device: torch.device) -> None:
        self.device = device
        self._host = [torch.zeros(self.ENTRIES, 2, dtype=torch.int32, pin_memory=True) for _ in range(self.BUFFERS)]
        self._views = [buffer.numpy() for buffer in self._host]
        self._copied = [torch.cuda.Event() for _ in range(self.BUFFERS)]
        self._turn = 0
        self._staged = torch.zeros(self.ENTRIES, 2, dtype=torch.int32, device=device)
        self._graph = capture_graph(lambda: apply_writes(self._staged), device)

    def write(self, entries: list[tuple[int, int]]) -> bool:
        """Write `entries` of (cell, block) in stream order; False (nothing written) where they are too many."""
        if len(entries) > self.ENTRIES:
            return False
        turn = self._turn
        self._turn = (turn + 1) % self.BUFFERS
        self._copied[turn].synchronize()  # (long since, mostly: three writes ago)
        view = self._views[turn]
        view[: len(entries)] = entries
        view[len(entries) :] = 0
        with torch.cuda.device(self.device):
            self._staged.copy_(self._host[turn], non_blocking=True)
            self._copied[turn].record()
            self._graph.replay()
        return True


class BlockTables:
    """Which blocks each sequence row owns: on the host its list of blocks, on the device its block table and length.

    Rows are what sequences own (lengths, tables and every caller index by row; the last row is the runner's
    scratch row, whose table points at the trash block only). Position p of row r lives at offset p % block_size of
    block `tables[r, p // block_size]`. The host keeps each row's blocks (`reserve` before a step takes what its
    writes need, `trim` gives back what a rollback left empty); the device keeps `tables` and `lengths`, which steps
    and their graphs read and write. Table entries past a row's blocks name the trash block, where padding writes
    land (`trim`). Every table change is pending on the host until `flush` writes it: right after a step's launch
    (`keep_ahead`), or before the next step. The blocks come from `pool`, which the cache allocates
    (`PagedKVCache.allocate`).
    """

    def __init__(
        self, num_rows: int, max_len: int, block_size: int, device: torch.device | str, prefix_caching: bool = True
    ) -> None:
        self.num_rows = num_rows
        self.max_len = max_len
        self.block_size = block_size
        self.device = torch.device(device)
        self.prefix_caching = prefix_caching
        self.max_blocks = -(-max_len // block_size)  # per row
        self.lengths = torch.zeros(num_rows, dtype=torch.long, device=device)
        # The tables live in `_cells` after TABLE_START cells: a table write to cell 0 (an empty entry, which pads a
        # `TableWriter`'s) lands there and changes no table.
        # An inference tensor, as the K/V pools are: a mutating operator given a normal tensor (the rotary write
        # takes the tables) goes through autograd's Python version-counter hook, ~35 us a layer of an eager forward.
        with torch.inference_mode():
            self._cells = torch.full(
                (TABLE_START + num_rows * self.max_blocks,), TRASH_BLOCK, dtype=torch.int32, device=device
            )
        self.tables = self._cells[TABLE_START:].view(num_rows, self.max_blocks)
        # On a CPU the host writes table entries straight into the tensor's memory: one numpy assignment a flush.
        self._host_cells = self._cells.numpy() if self.device.type == "cpu" else None
        self.row_blocks: list[list[int]] = [[] for _ in range(num_rows)]
        self.held = np.zeros(num_rows, dtype=np.int64)  # len(row_blocks[r]), for vectorized checks
        # Table entries the device has not yet (every change goes here first), by their cell of `_cells`
        # (`_cell`). `_pending`, cell -> block: blocks a row took, which a step must have before it runs. `_freed`:
        # cells of columns a row gave back, to point at the trash block: only a prefill's padding writes past a
        # row's blocks, so they wait for the flush before an eager step (`flush(freed=True)`).
        self._pending: dict[int, int] = {}
        self._freed: set[int] = set()
        self.table_writer: TableWriter | None = None  # `flush`'s way on CUDA, where the runner captures graphs
        self.pool: BlockPool | None = None

    # -- rows' blocks (host) --------------------------------------------------------------------------------------
    def reserve(self, rows: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray) -> None:
        """Blocks for positions `[0, ends[i])` of each (distinct) row: all of them or, raising CapacityError, none.
        Checked on arrays: mostly the steps before took them (`keep_ahead`), and one comparison says so."""
        rows, ends = np.asarray(rows, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        held = self.held[rows]
        if (ends <= held * self.block_size).all():
            return
        if ends.max() > self.max_len:
            raise CapacityError(f"a sequence would reach {ends.max()} tokens, beyond max_model_len {self.max_len}")
        counts = -(-ends // self.block_size) - held
        short = counts > 0
        self._take(rows[short], counts[short])

    def keep_ahead(self, rows: Sequence[int] | np.ndarray, ends: Sequence[int] | np.ndarray) -> None:
        """Once a step of `rows` is launched, while the GPU runs it: each row keeps blocks for positions `[0,
        ends[i])`, the most its next step may reach, and no more (`trim`); those it lacks are taken where the pool
        can spare them all (up to `max_len`; never a CapacityError) and their table entries written now, in stream
        order. The next step then finds its blocks and entries in place and costs the host a check before its
        launch. Mostly every row holds what it should already, which one comparison says."""
        rows = np.asarray(rows, dtype=np.int64)
        wanted = -(-np.minimum(ends, self.max_len) // self.block_size)
        held = self.held[rows]
        if (held != wanted).any():
            over = held > wanted
            if over.any():
                self._drop(rows[over].tolist(), wanted[over].tolist())
            counts = wanted - held
            short = counts > 0
            if short.any():
                counts = counts[short]
                assert self.pool is not None
                if counts.sum() <= self.pool.available:
                    self._take(rows[short], counts)
        if self._pending:
            self.flush(freed=False)

    def _take(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """`counts[i]` more blocks for each (distinct) row `rows[i]`, or a CapacityError and none."""
        assert self.pool is not None
        total = int(counts.sum())
        if total > self.pool.available:
            raise CapacityError(
                f"the KV cache is out of blocks: this step needs {total} more, {self.pool.available} are free "
                f"of {self.pool.usable}"
            )
        taken, start, freed, pending = self.pool.take(total), 0, self._freed, self._pending
        for row, count in zip(rows.tolist(), counts.tolist()):
            held = self.row_blocks[row]
            first = self._cell(row, len(held))
            blocks = taken[start : start + count]
            pending.update(zip(range(first, first + count), blocks))
            if freed:
                freed.difference_update(range(first, first + count))
            held += blocks
            start += count
        self.held[rows] += counts

    def trim(self, rows: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Give back each row's blocks past its first `lengths[i]` positions (what a rollback left empty), their table
        entries pointed at the trash block before the next prefill (`_freed`): a prefill pads its shorter prompts
        with writes past what they reserved, which a stale entry would send into a block another row now holds."""
        rows = np.asarray(rows, dtype=np.int64)
        keep = -(-np.asarray(lengths, dtype=np.int64) // self.block_size)
        over = self.held[rows] > keep
        if over.any():
            self._drop(rows[over].tolist(), keep[over].tolist())

    def _drop(self, rows: list[int], keep: list[int]) -> None:
        """Each row `rows[i]` gives back its blocks past its first `keep[i]` (`trim`)."""
        assert self.pool is not None
        for row, kept in zip(rows, keep):
            held = self.row_blocks[row]
            self.pool.free(held[kept:])
            for cell in range(self._cell(row, kept), self._cell(row, len(held))):
                self._freed.add(cell)
                self._pending.pop(cell, None)
            del held[kept:]
            self.held[row] = kept

    def release(self, rows: Sequence[int]) -> None:
        """Every block of `rows` back to the pool (cached ones stay cached), their table entries pointed at the trash
        block (`trim`)."""
        self.trim(rows, [0] * len(rows))

    def share_prefix(
        self, row: int, prompt: Sequence[int], keys: Sequence[bytes] | None = None, *, again: bool = False
    ) -> int:
        """Give a row that holds only shared prompt blocks so far (none at first) the further cached blocks its prompt
        starts with; the tokens all its blocks hold. The last prompt token is never among them: its forward gives the
        logits of the first new token. `keys`: the prompt's `prefix_keys`, where the caller has them; `again`: a
        later look of the same prefill (`SequenceTable.prefill`), whose prompt the stats counted as queried once."""
        assert self.pool is not None
        held = len(self.row_blocks[row])
        if not self.pool.prefix_caching:
            return held * self.block_size
        keys = self.prefix_keys(prompt) if keys is None else keys
        blocks = self.pool.share_prefix(keys[held:])
        self.pool.record_lookup(0 if again else len(prompt), len(blocks) * self.block_size)
        self.row_blocks[row] += blocks
        self.held[row] = len(self.row_blocks[row])
        for cell, block in enumerate(blocks, self._cell(row, held)):
            self._pending[cell] = block
            self._freed.discard(cell)
        return (held + len(blocks)) * self.block_size

    def prefix_keys(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of the full blocks a prompt can share: all its tokens but the last (`share_prefix`)."""
        return block_hashes(prompt[: len(prompt) - 1], self.block_size)

    def register_prompt(self, row: int, prompt: Sequence[int]) -> None:
        """Cache the full blocks of a row's prompt, once its prefill has written them."""
        assert self.pool is not None
        keys = block_hashes(prompt, self.block_size)
        self.pool.register(self.row_blocks[row][: len(keys)], keys)

    def flush(self, freed: bool = True) -> None:
        """Write the table entries the device has not yet, in stream order: before a step, or once a step is launched
        (`keep_ahead`). `freed`: also those of freed columns (`_freed`), which only an eager step (a prefill, whose
        padding writes past its rows' blocks) needs."""
        if freed and self._freed:
            self._pending.update(dict.fromkeys(self._freed, TRASH_BLOCK))  # (no cell is in both)
            self._freed.clear()
        if not self._pending:
            return
        if self._host_cells is not None:
            self._host_cells[list(self._pending)] = list(self._pending.values())
        else:
            entries = list(self._pending.items())
            if self.table_writer is None or not self.table_writer.write(entries):
                writes = torch.from_numpy(np.array(entries, dtype=np.int32))
                if self.device.type == "cuda":  # pinned: a copy from pageable memory may wait for the step it follows
                    writes = writes.pin_memory()
                self.apply_writes(writes.to(self.device, non_blocking=True))
        self._pending.clear()

    def apply_writes(self, writes: torch.Tensor) -> None:
        """Table entries `[..., 2]` of (cell, block) on the device (`flush`). An empty entry (zeros) writes cell 0,
        outside the tables."""
        cells, blocks = writes.view(-1, 2).unbind(1)
        with torch.inference_mode():  # (the tables are an inference tensor)
            self._cells[cells] = blocks

    def _cell(self, row: int, column: int) -> int:
        """The cell of `_cells` holding table entry (row, column)."""
        return TABLE_START + row * self.max_blocks + column
