"""Slot KV cache: one preallocated row per sequence, per-row lengths, rollback by lowering a length."""

from __future__ import annotations

from types import ModuleType

import torch
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from minedraft.kernels import triton_runs

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

    With `num_layers` (a model on one device) all layers' K/V live in two stacks `[layers, rows, ...]` and
    `keys`/`values` are views of them; without it (a model spread over GPUs) each layer's lives on its GPU.
    """

    def __init__(self, num_rows: int, max_len: int, device: torch.device | str, num_layers: int | None = None) -> None:
        super().__init__(layers=[])
        # Allocated at the first update, from the shapes the model itself produces: no need to know each
        # architecture's head layout.
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.num_layers = num_layers
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._layer_index: torch.Tensor | None = None
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
        # (tensor, its row dimension): two copies for a stacked cache, two per layer otherwise
        pieces = [(t, 1) for t in self._stacks] if self._stacks else [(t, 0) for t in self.keys + self.values]
        for t, dim in pieces:
            if t.device != src.device:
                src, dst = src.to(t.device), dst.to(t.device)
            t.index_copy_(dim, dst, t.index_select(dim, src))

    def update(  # type: ignore[override]
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._rows is not None and self._positions is not None, "SlotKVCache.select() was not called"
        if not self.stacked:
            return self._update_layer(key_states, value_states, layer_idx)
        self.write(key_states, value_states, layer_idx)
        return self.read(layer_idx)

    @property
    def stacked(self) -> bool:
        """Whether all layers' K/V live in two stacks (allocated, on one device): `write` and `read` apply."""
        return self._stacks is not None

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Write a stacked cache's new K/V of layer `layer_idx` (`update` without the read; the fused Llama-family
        layers `rotate_and_write` instead). The layer index stays a symbolic int in compiled layers, so that one
        compiled layer serves every layer: it indexes the stacks, where indexing a Python list would compile each
        layer anew.
        """
        assert self._stacks is not None and self._layer_index is not None and self._rows is not None
        keys, values = self._stacks
        if key_states.shape[1] != keys.shape[2] or key_states.shape[3] != keys.shape[4]:
            raise ValueError(
                f"layer {layer_idx} has K/V heads of shape {tuple(key_states.shape[1::2])}, layer 0 "
                f"{tuple(keys.shape[2::2])}: a stacked cache needs the same in every layer"
            )
        # keys[layer, rows[b], :, positions[b, i]] = key_states[b, :, i]
        index = [self._layer_index[layer_idx], self._rows[:, None], None, self._positions]
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
            projections, cos, sin, keys, values, layer_idx, self._rows, self._positions, heads, kv_heads
        )
        return query.transpose(1, 2)

    # Outside compiled layers: the key length and the block's start are Python ints that compiled code would
    # specialise on (a compile, or an uncompiled layer, for every block and bucket not seen in the warm-up).
    @torch.compiler.disable
    def read(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K/V of the selected rows up to the step's key length (see `_read`)."""
        assert self._rows is not None
        return self._read(layer_idx, self._rows)

    # Outside compiled layers: the first forward allocates, and the layers of a model spread over GPUs index a list
    # by their layer index, a Python int that would make every layer compile anew.
    @torch.compiler.disable
    def _update_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            self._allocate(key_states, value_states)
            if self._stacks is not None:
                return self.update(key_states, value_states, layer_idx)
        assert self._rows is not None and self._positions is not None
        rows, positions = self._rows, self._positions
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys.device != rows.device:  # a model spread over several GPUs: this layer lives elsewhere
            rows, positions = rows.to(keys.device), positions.to(keys.device)
        # keys[rows[b], :, positions[b, i]] = key_states[b, :, i]
        keys[rows[:, None], :, positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows[:, None], :, positions] = value_states.transpose(1, 2).to(values.dtype)
        return self._read(layer_idx, rows)

    def _read(self, layer_idx: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s K/V of the batch's (cache) `rows` up to the step's key length: a view of a block, or
        gathered."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._view_start is not None:
            start, end = self._view_start, self._view_start + rows.numel()
            return keys[start:end, :, : self._kv_len], values[start:end, :, : self._kv_len]
        return keys[rows, :, : self._kv_len], values[rows, :, : self._kv_len]

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, head_dim = key_states.shape
        if self.num_layers is None:
            self.keys.append(key_states.new_zeros(self.num_slots, heads, self.max_len, head_dim))
            self.values.append(value_states.new_zeros(self.num_slots, heads, self.max_len, value_states.shape[-1]))
            return
        shape = (self.num_layers, self.num_slots, heads, self.max_len)
        self._stacks = (key_states.new_zeros(*shape, head_dim), value_states.new_zeros(*shape, value_states.shape[-1]))
        self.keys, self.values = list(self._stacks[0].unbind(0)), list(self._stacks[1].unbind(0))
        self._layer_index = torch.arange(self.num_layers, device=key_states.device)

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
        return [
            (k[cache_row, :, :length].clone(), v[cache_row, :, :length].clone()) for k, v in zip(self.keys, self.values)
        ]


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
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Rotary embedding and K/V write of a Llama-family layer (Mistral's and Qwen2's rotary are copies of Llama's):
    the rotated queries `[B, n, heads, D]`; keys and values go to `keys[layer, rows[b], :, positions[b, i]]` (and
    `values`), stacks `[layers, cache_rows, kv_heads, max_len, D]`. An operator, so compiled layers call the kernel
    as it is; where the kernel does not run, transformers' own arithmetic."""
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
        return ROTARY_KERNEL.rotate_and_write(projections, cos, sin, keys, values, rows, positions, heads, kv_heads)
    query, key, value = projections.view(batch, queries, -1, dim).split([heads, kv_heads, kv_heads], dim=2)
    query, key = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)  # [B, n, heads, D] as they come
    keys[rows[:, None], :, positions] = key  # keys[rows[b], :, positions[b, i]] = key[b, i]
    values[rows[:, None], :, positions] = value
    return query.contiguous()


@rotate_and_write.register_fake
def _(
    projections: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    return projections.new_empty(*projections.shape[:2], heads, keys.shape[-1])
