"""Paged KV cache: every layer's K/V in fixed-size blocks, a block table and a length per sequence row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from minedraft.engine.block_pool import TRASH_BLOCK, BlockPool, block_hashes
from minedraft.engine.cuda_graphs import capture_graph
from minedraft.errors import CapacityError
from minedraft.kernels import triton_runs

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


# Why not transformers' PagedAttentionCache: it is bound to its own continuous-batching manager (flattened varlen
# batches, a scheduler that allocates its blocks itself) and has no per-row rollback. Speculative verify needs
# rollback as one length write and static shapes for CUDA graphs: here a step's shape is its batch, and the block
# tables and lengths are tensors the graph reads.


@dataclass(frozen=True)
class LayerSpec:
    """The K/V one layer caches per token, as its first forward produced them."""

    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        return self.kv_heads * (self.key_dim + self.value_dim) * self.dtype.itemsize


class PagedKVCache(Cache):
    """K/V of every layer as blocks `[num_blocks, kv_heads, block_size, head_dim]`; rows own blocks through tables.

    Rows are what sequences own (lengths, tables and every caller index by row; the last row is the runner's
    scratch row, whose table points at the trash block only). Position p of row r lives at offset p % block_size of
    block `tables[r, p // block_size]`. The host keeps each row's blocks (`reserve` before a step takes what its
    writes need, `trim` gives back what a rollback left empty); the device keeps `tables` and `lengths`, which steps
    and their graphs read and write. K/V at or beyond a row's length are garbage no read reaches; table entries past
    its blocks name the trash block, where padding writes land (`trim`). Every table change is pending on the host
    until `flush` writes it: right after a step's launch (`keep_ahead`), or before the next step.

    Before each forward the runner calls `select(rows, positions, kv_len)`; every layer's `update` then writes its
    new keys/values and returns what attention reads: with a `kv_len`, the rows' K/V gathered into `[B, kv_heads,
    kv_len, D]` (prefills, CPUs: masks hide what lies past a row's length); without, the layer's blocks themselves,
    which the Triton kernels read through the tables (`minedraft.kernels.decode_attention`).

    With all layers alike on one device their blocks live in two stacks `[layers, num_blocks, ...]` (`stacked`);
    otherwise (a model spread over GPUs) each layer's on its own device.
    """

    def __init__(
        self, num_rows: int, max_len: int, block_size: int, device: torch.device | str, prefix_caching: bool = True
    ) -> None:
        super().__init__(layers=[])
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
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._layer_index: torch.Tensor | None = None
        self.specs: list[LayerSpec] | None = None  # once probed
        self._probing = False
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._write_at: tuple[torch.Tensor, torch.Tensor] | None = None  # (blocks, offsets) [B, n] of new tokens
        self._kv_len: int | None = None
        self._gathered_blocks: torch.Tensor | None = None  # the selected rows' blocks, as `_gather` reads them
        # Whether every layer writes its new K/V itself (`rotate_and_write`, set by the runner): then `select` makes
        # no write positions, four kernels a forward that a draft's proposal ran four times for nothing.
        self.kernel_writes = False

    # -- allocation -----------------------------------------------------------------------------------------------
    def probe(self) -> None:
        """The next forward records each layer's K/V shapes (`specs`) and attends only to its own tokens."""
        self._probing, self.specs = True, []

    @property
    def bytes_per_block(self) -> int:
        assert self.specs, "probe the model first"
        return sum(s.bytes_per_token for s in self.specs) * self.block_size

    def allocate(self, num_blocks: int) -> None:
        """Every layer's blocks, zeroed (garbage must be finite: a gathered read masks it, and NaN survives a
        mask)."""
        assert self.specs, "probe the model first"
        first = self.specs[0]
        if all(s == first for s in self.specs) and first.device == self.device:
            stack = (len(self.specs), num_blocks, first.kv_heads, self.block_size)
            self._stacks = (
                torch.zeros(*stack, first.key_dim, dtype=first.dtype, device=first.device),
                torch.zeros(*stack, first.value_dim, dtype=first.dtype, device=first.device),
            )
            self.keys, self.values = list(self._stacks[0].unbind(0)), list(self._stacks[1].unbind(0))
            self._layer_index = torch.arange(len(self.specs), device=self.device)
        else:
            for s in self.specs:
                shape = (num_blocks, s.kv_heads, self.block_size)
                self.keys.append(torch.zeros(*shape, s.key_dim, dtype=s.dtype, device=s.device))
                self.values.append(torch.zeros(*shape, s.value_dim, dtype=s.dtype, device=s.device))
        self.pool = BlockPool(num_blocks, self.prefix_caching)

    @property
    def stacked(self) -> bool:
        """Whether all layers' K/V live in two stacks (on one device): `write`, `read` and `rotate_and_write` apply."""
        return self._stacks is not None

    @property
    def kv_heads(self) -> int:
        return self.specs[0].kv_heads if self.specs else 0

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

    # -- a forward --------------------------------------------------------------------------------------------------
    def select(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int | None) -> None:
        """Point the next forward at `rows` ([B]) writing at `positions` ([B, n]); attention reads `kv_len` keys
        gathered per row, or (None) the blocks through the tables."""
        self._rows, self._positions, self._kv_len = rows, positions, kv_len
        self._write_at = None
        self._gathered_blocks = None
        if not self.kernel_writes:
            blocks = self.tables[rows[:, None], torch.div(positions, self.block_size, rounding_mode="floor")]
            self._write_at = (blocks.long(), positions % self.block_size)

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._probing:
            return self._record(key_states, value_states, layer_idx)
        if self.stacked:
            self.write(key_states, value_states, layer_idx)
            return self.read(layer_idx)
        return self._update_layer(key_states, value_states, layer_idx)

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Write a stacked cache's new K/V of layer `layer_idx` (`update` without the read). The layer index stays a
        symbolic int in compiled layers, so that one compiled layer serves every layer: it indexes the stacks, where
        indexing a Python list would compile each layer anew."""
        assert self._stacks is not None and self._layer_index is not None and self._write_at is not None
        keys, values = self._stacks
        blocks, offsets = self._write_at
        # keys[layer, blocks[b, i], :, offsets[b, i]] = key_states[b, :, i]
        index = [self._layer_index[layer_idx], blocks, None, offsets]
        torch.ops.aten.index_put_(keys, index, key_states.transpose(1, 2).to(keys.dtype))  # (None: all heads)
        torch.ops.aten.index_put_(values, index, value_states.transpose(1, 2).to(values.dtype))

    def rotate_and_write(
        self, projections: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, layer_idx: int
    ) -> torch.Tensor:
        """The rotated queries `[B, heads, n, D]` of a fused Q/K/V projection's output `[B, n, (heads + 2 kv_heads)
        D]`, with its rotated keys and its values written to layer `layer_idx` of a stacked cache (`write`): one
        kernel on CUDA (`minedraft.kernels.rotary_write`) where compiled code gave three."""
        assert self._stacks is not None and self._rows is not None and self._positions is not None
        keys, values = self._stacks
        query = torch.ops.minedraft.rotate_and_write(
            projections, cos, sin, keys, values, layer_idx, self.tables, self._rows, self._positions, heads, kv_heads
        )
        return query.transpose(1, 2)

    # Outside compiled layers: the layer index is a symbolic int there, and a list indexed by it (or a view of the
    # stacks at it) does not trace; the attention after it compiles as the next frame.
    @torch.compiler.disable
    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads of layer `layer_idx`: its blocks (paged reads) or the rows' K/V gathered."""
        if self._kv_len is None:
            return self.keys[layer_idx], self.values[layer_idx]
        return self._gather(layer_idx)

    # Outside compiled layers: the key length is a Python int that compiled code would specialise on.
    @torch.compiler.disable
    def _gather(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K/V of the selected rows' first `kv_len` positions, `[B, kv_heads, kv_len, D]`."""
        assert self._rows is not None and self._kv_len is not None
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        columns = -(-self._kv_len // self.block_size)
        blocks = self._gathered_blocks
        if blocks is None or blocks.device != keys.device:  # once a forward (per device, for a model spread over GPUs)
            blocks = self.tables[self._rows.to(self.tables.device), :columns].to(keys.device).long()
            self._gathered_blocks = blocks

        def gathered(pool: torch.Tensor) -> torch.Tensor:
            batch, heads, dim = blocks.shape[0], pool.shape[1], pool.shape[-1]
            # Whole blocks selected, then heads moved before positions: two plain copies, half the time of one
            # indexed by (block, head) at once on a CPU (a batch of 32 rows of 10 blocks: 104 against 220 us).
            rows = pool.index_select(0, blocks.flatten()).view(batch, columns, heads, self.block_size, dim)
            return rows.transpose(1, 2).reshape(batch, heads, columns * self.block_size, dim)[:, :, : self._kv_len]

        return gathered(keys), gathered(values)

    # Outside compiled layers: the layers of a model spread over GPUs index a list by their layer index, a Python
    # int that would make every layer compile anew.
    @torch.compiler.disable
    def _update_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._write_at is not None
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        blocks, offsets = (t.to(keys.device) for t in self._write_at)
        keys[blocks, :, offsets] = key_states.transpose(1, 2).to(keys.dtype)
        values[blocks, :, offsets] = value_states.transpose(1, 2).to(values.dtype)
        return self.read(layer_idx)

    def _record(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.specs is not None and layer_idx == len(self.specs)
        _, heads, _, key_dim = key_states.shape
        self.specs.append(LayerSpec(heads, key_dim, value_states.shape[-1], key_states.dtype, key_states.device))
        return key_states, value_states

    def end_probe(self) -> None:
        self._probing = False

    # -- transformers' Cache interface ---------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max().item()) if self.num_rows else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # type: ignore[override]
        return self._kv_len or query_length, 0

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def rows_state(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The committed K/V of row `row`, per layer, as `[kv_heads, length, head_dim]` (for tests and debugging)."""
        length = int(self.lengths[row])
        blocks = self.row_blocks[row][: -(-length // self.block_size)]
        state = []
        for k, v in zip(self.keys, self.values):
            index = torch.tensor(blocks, dtype=torch.long, device=k.device)
            state.append(
                tuple(t[index].transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1])[:, :length].clone() for t in (k, v))
            )
        return state  # type: ignore[return-value]


def _rotary_write_kernels() -> ModuleType | None:
    if not triton_runs():
        return None
    from minedraft.kernels import rotary_write

    return rotary_write


# Loaded here, not in the operator: compiled layers call it, and an import has no business there.
ROTARY_KERNEL = _rotary_write_kernels()


@torch.library.custom_op("minedraft::rotate_and_write", mutates_args=("keys", "values"))
def rotate_and_write(
    projections: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Rotary embedding and K/V write of a Llama-family layer (Mistral's and Qwen2's rotary are copies of Llama's):
    the rotated queries `[B, n, heads, D]`; keys and values go to position `positions[b, i]` of row `rows[b]` of
    layer `layer` (`PagedKVCache`), stacks `[layers, num_blocks, kv_heads, block_size, D]`. An operator, so compiled
    layers call the kernel as it is; where the kernel does not run, transformers' own arithmetic."""
    batch, queries = projections.shape[:2]
    dim = keys.shape[-1]
    if keys.shape[2] != kv_heads or projections.shape[-1] != (heads + 2 * kv_heads) * dim:
        raise ValueError(
            f"layer {layer} projects {projections.shape[-1]} features for {heads} query and {kv_heads} "
            f"K/V heads, the cache holds {keys.shape[2]} K/V heads of size {dim}: a stacked cache needs "
            "the same in every layer"
        )
    keys, values = keys[layer], values[layer]
    if ROTARY_KERNEL is not None and ROTARY_KERNEL.supports(projections, cos, keys, dim):
        return ROTARY_KERNEL.rotate_and_write(
            projections, cos, sin, keys, values, tables, rows, positions, heads, kv_heads
        )
    query, key, value = projections.view(batch, queries, -1, dim).split([heads, kv_heads, kv_heads], dim=2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)  # [B, n, heads, D] as they come
    block_size = keys.shape[2]
    blocks = tables[rows[:, None], torch.div(positions, block_size, rounding_mode="floor")].long()
    offsets = positions % block_size
    keys[blocks, :, offsets] = key  # keys[blocks[b, i], :, offsets[b, i]] = key[b, i]
    values[blocks, :, offsets] = value
    return query.contiguous()


@rotate_and_write.register_fake
def _(
    projections: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    return projections.new_empty(*projections.shape[:2], heads, keys.shape[-1])
