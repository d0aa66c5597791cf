"""Slot KV cache: one preallocated row per sequence, per-row lengths, rollback by lowering a length."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

# Why not transformers' PagedAttentionCache: it is bound to its own continuous-batching manager (flattened varlen
# batches, block tables it allocates itself) and has no per-row rollback. A row-per-sequence tensor gives rollback
# as one integer write and static shapes for CUDA graphs, which is what speculative verify needs.


class SlotKVCache(Cache):
    """K/V of every layer as `[cache_rows, kv_heads, max_len, head_dim]`; a forward touches a subset of rows.

    Sequences own logical rows (what lengths, sampling parameters and every caller index); `physical` maps each to
    the cache row holding its K/V, so that the runner can move a batch's K/V into one block of rows
    (`ModelRunner.arrange`) without anyone else noticing. Before each forward the runner calls `select(rows,
    positions, kv_len, view_start)`; every layer's `update` then writes the new keys/values of row `rows[b]` at
    `positions[b]` and returns the batch's keys/values `[:kv_len]`. Entries at or beyond a row's committed length
    are garbage that the attention mask hides, so rollback never clears memory.

    A batch whose rows fill cache rows `[view_start, view_start + B)` in order reads its K/V as a view, with no
    copy; any other batch gathers its rows, a copy that took 8 of the 19 ms of kernels of an 8B verify at batch 32
    on an H200 with this layout (kv_heads strided pieces per row; with positions first the gather was 3x faster,
    but attention on a few queries then had to copy K into a head-major layout for its matmuls).
    """

    def __init__(self, num_rows: int, max_len: int, device: torch.device | str) -> None:
        super().__init__(layers=[])
        # Allocated per layer at its first update, from the shapes the model itself produces: no need to know
        # each architecture's head layout.
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_slots = num_rows
        self.max_len = max_len
        self.lengths = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.physical = torch.arange(num_rows, device=device)  # logical row -> cache row
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._kv_len = 0
        self._view_start: int | None = None

    def select(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int, view_start: int | None) -> None:
        """Point the next forward at logical `rows` ([B]) writing at `positions` ([B, n]), attending over `kv_len`
        keys; `view_start`: the batch's K/V fill cache rows `[view_start, view_start + B)` in order."""
        self._rows = self.physical[rows]
        self._positions = positions
        self._kv_len = kv_len
        self._view_start = view_start

    def move(self, sources: list[int], destinations: list[int]) -> None:
        """Copy the K/V of cache rows `sources` to `destinations` (all rows read before any is written)."""
        if not self.keys or not sources:
            return
        src = torch.tensor(sources, device=self.keys[0].device)
        dst = torch.tensor(destinations, device=self.keys[0].device)
        for tensors in (self.keys, self.values):
            for t in tensors:
                if t.device != src.device:
                    src, dst = src.to(t.device), dst.to(t.device)
                t[dst] = t[src]

    # Outside compiled layers (compile_decoder_layers): it indexes per-layer tensors by the layer's index, a Python
    # int that would make every layer compile anew, and writes into the cache in place.
    @torch.compiler.disable
    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._rows is not None and self._positions is not None, "SlotKVCache.select() was not called"
        rows, positions = self._rows, self._positions
        if layer_idx == len(self.keys):
            self._allocate(key_states, value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys.device != rows.device:  # a model spread over several GPUs: this layer lives elsewhere
            rows, positions = rows.to(keys.device), positions.to(keys.device)
        # keys[rows[b], :, positions[b, i]] = key_states[b, :, i]
        keys[rows[:, None], :, positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows[:, None], :, positions] = value_states.transpose(1, 2).to(values.dtype)
        if self._view_start is not None:
            start, end = self._view_start, self._view_start + rows.numel()
            return keys[start:end, :, : self._kv_len], values[start:end, :, : self._kv_len]
        return keys[rows, :, : self._kv_len], values[rows, :, : self._kv_len]

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        self.keys.append(key_states.new_zeros(self.num_slots, heads, self.max_len, head_dim))
        self.values.append(value_states.new_zeros(self.num_slots, heads, self.max_len, value_states.shape[-1]))

    @property
    def kv_heads(self) -> int:
        """K/V heads of the first layer (0 before the first forward allocates the cache)."""
        return int(self.keys[0].shape[1]) if self.keys else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lengths.max().item()) if self.num_slots else 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:  # type: ignore[override]
        return self._kv_len, 0

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return True

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def rows_state(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The committed K/V of logical row `row`, per layer, as `[kv_heads, length, head_dim]` (for tests and
        debugging)."""
        length, cache_row = int(self.lengths[row]), int(self.physical[row])
        return [(k[cache_row, :, :length].clone(), v[cache_row, :, :length].clone())
                for k, v in zip(self.keys, self.values)]
