"""Paged KV cache: every layer's K/V in fixed-size blocks, a block table and a length per sequence row."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from minedraft.engine.block_pool import BlockPool
from minedraft.engine.block_tables import BlockTables
from minedraft.kernels import triton_runs

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


class PagedKVCache(BlockTables, Cache):
    """K/V of every layer as blocks `[num_blocks, kv_heads, block_size, head_dim]`; rows own blocks through tables
    (`BlockTables`). K/V at or beyond a row's length are garbage no read reaches.

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
        Cache.__init__(self, layers=[])
        BlockTables.__init__(self, num_rows, max_len, block_size, device, prefix_caching)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        self._layer_index: torch.Tensor | None = None
        self.specs: list[LayerSpec] | None = None  # once probed
        self._probing = False
        self._rows: torch.Tensor | None = None
        self._read_rows: torch.Tensor | None = None  # the rows attention reads, where not `_rows` (a ragged step)
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

    # -- a forward --------------------------------------------------------------------------------------------------
    def select(
        self, rows: torch.Tensor, positions: torch.Tensor, kv_len: int | None, read_rows: torch.Tensor | None = None
    ) -> None:
        """Point the next forward at `rows` ([B]) writing at `positions` ([B, n]); attention reads `kv_len` keys
        gathered per row of `read_rows` (default `rows`; a ragged verify writes per token, `ForwardPass`), or (None)
        the blocks through the tables."""
        self._rows, self._positions, self._kv_len = rows, positions, kv_len
        self._read_rows = rows if read_rows is None else read_rows
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
        assert self._read_rows is not None and self._kv_len is not None
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        columns = -(-self._kv_len // self.block_size)
        blocks = self._gathered_blocks
        if blocks is None or blocks.device != keys.device:  # once a forward (per device, for a model spread over GPUs)
            blocks = self.tables[self._read_rows.to(self.tables.device), :columns].to(keys.device).long()
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
