"""Slot KV cache: one preallocated row per sequence, per-row lengths, rollback by lowering a length."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

# Why not transformers' PagedAttentionCache: it is bound to its own continuous-batching manager (flattened varlen
# batches, block tables it allocates itself) and has no per-row rollback. A row-per-sequence tensor gives rollback
# as one integer write and static shapes for CUDA graphs, which is what speculative verify needs.


class SlotKVCache(Cache):
    """K/V of every layer as `[num_slots, max_len, kv_heads, head_dim]`; a forward touches a subset of rows.

    Before each forward the runner calls `select(rows, positions, kv_len)`; every layer's `update` then writes the
    new keys/values of row `rows[b]` at `positions[b]` and returns that row's keys/values `[:kv_len]`. Entries at or
    beyond a row's committed length are garbage that the attention mask hides, so rollback never clears memory.

    Position before head: a row's first `kv_len` positions are then one contiguous block, which a batch's gather
    copies at about 1000 GB/s on an H200; with heads first it read `kv_heads` strided pieces per row at about 330
    GB/s, 8 ms of an 8B verify at batch 32 (max length 2048, 768 keys). Attention takes the `[B, heads, kv_len,
    head_dim]` view the transpose gives.
    """

    def __init__(self, num_slots: int, max_len: int, device: torch.device | str) -> None:
        super().__init__(layers=[])
        # Allocated per layer at its first update, from the shapes the model itself produces: no need to know
        # each architecture's head layout.
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_slots = num_slots
        self.max_len = max_len
        self.lengths = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._kv_len = 0
        self._contiguous = False

    def select(self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int, contiguous: bool) -> None:
        """Point the next forward at `rows` ([B]) writing at `positions` ([B, n]), attending over `kv_len` keys.

        `contiguous` says rows are 0..B-1 in order: then keys are read as views, without a gather copy.
        """
        self._rows = rows
        self._positions = positions
        self._kv_len = kv_len
        self._contiguous = contiguous

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
        # keys[rows[b], positions[b, i]] = key_states[b, :, i]
        if keys.device != rows.device:  # a model spread over several GPUs: this layer lives elsewhere
            rows, positions = rows.to(keys.device), positions.to(keys.device)
        keys[rows[:, None], positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows[:, None], positions] = value_states.transpose(1, 2).to(values.dtype)
        if self._contiguous:
            batch = rows.numel()
            keys, values = keys[:batch, : self._kv_len], values[:batch, : self._kv_len]
        else:
            keys, values = keys[rows, : self._kv_len], values[rows, : self._kv_len]
        return keys.transpose(1, 2), values.transpose(1, 2)

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        shape = (self.num_slots, self.max_len, heads)
        self.keys.append(key_states.new_zeros(*shape, head_dim))
        self.values.append(value_states.new_zeros(*shape, value_states.shape[-1]))

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
        """The committed K/V of one row, per layer, as `[kv_heads, length, head_dim]` (for tests and debugging)."""
        length = int(self.lengths[row])
        return [(k[row, :length].transpose(0, 1).clone(), v[row, :length].transpose(0, 1).clone())
                for k, v in zip(self.keys, self.values)]
