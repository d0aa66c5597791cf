"""The forward proper of a causal LM over a paged KV cache, inside a step: positions, masks, layers, logits."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig, PreTrainedModel

from minedraft.engine.attention import (
    CAUSAL_BY_POSITIONS,
    FUSED_MIN_BLOCKS,
    GROUPED_SDPA,
    PAGED,
    RAGGED,
    SHORT_QUERY,
    paged_kernel,
)
from minedraft.engine.batch_invariant import DETERMINISTIC, invariant_mode
from minedraft.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)


# Step and StepShape are made every step: not frozen, which takes four times as long to make.
@dataclass(slots=True)
class StepShape:
    """The static shape of a step, which its CUDA graph is captured for: the batch padded to its bucket (on CUDA,
    where it runs as a graph) and the key length attention reads gathered (None: paged reads through the block
    tables, bounded by each row's own length)."""

    padded: int
    kv_len: int | None


def attention_layout(config: object) -> tuple[int | None, bool]:
    """(sliding window, whether full-attention layers are mixed in) as transformers' own masks would apply them."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return None, False
    if layer_types is None:  # Mistral style: every layer slides
        return int(window), False
    kinds = set(layer_types)
    if "sliding_attention" not in kinds:
        return None, False
    return int(window), kinds != {"sliding_attention"}


def paged_queries(config: PretrainedConfig, cache: PagedKVCache, deterministic: bool = False) -> int:
    """The most new tokens a step's rows may take and read K/V through the block tables (0: none may). Short steps
    do where the Triton kernels take the model's attention: then neither they nor their graphs depend on the key
    length. `deterministic`: every step does, prefills too, so that a position's attention is computed alike
    whichever step computes it."""
    text = config.get_text_config()
    if deterministic and cache.device.type == "cuda" and paged_kernel(cache.specs or [], text):
        return cache.max_len
    heads = int(getattr(text, "num_attention_heads", 1))
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)  # (the ratio a rank's shard keeps too)
    return (
        SHORT_QUERY // max(heads // kv_heads, 1)
        if cache.device.type == "cuda" and paged_kernel(cache.specs or [], text)
        else 0
    )


class ForwardPass:
    """A model's forward over its paged KV cache, free of host syncs so that a CUDA graph can capture it: the
    positions and masks (or the block tables, for paged reads), the model's layers, then the logits. Owns how
    compiled layers meet a kind of step: compiled on first use until warmed up (`warm_up`), uncompiled after."""

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, deterministic: bool = False) -> None:
        self.model = model
        # `--deterministic`: each row computed alike whatever the step holds (`batch_invariant`).
        self.deterministic = deterministic
        self.cache = cache
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # transformers >= 5.24 names the cache argument `cache`; older 5.x call it `past_key_values`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        softcap = getattr(model.config, "final_logit_softcapping", None)
        self._softcap = float(softcap) if softcap else None
        # A step's logits stay in the LM head's type: an argmax reads them as they are (the same token as from a
        # float32 copy), and sampling converts them (`sampling.processed_probs`). The copy took 28 us of an 8B
        # verify at B=16 on an H200, and the argmax's read of it 33.
        self.logits_dtype = torch.float32 if self._softcap else model.get_output_embeddings().weight.dtype
        # A ready 4-D mask is used as it is, so sliding windows must be built into it here.
        self.sliding_window, self.mixed_layers = attention_layout(model.config)
        # Our forwards use grouped SDPA; the model's own config is left as it is for anyone else calling it.
        own = getattr(model.config, "_attn_implementation", None)
        self._attention = GROUPED_SDPA if own == "sdpa" else own
        self.warmed_up = False  # compiled layers: every kind of step compiled (warm_up)
        # How compiled layers meet a kind of step the warm-up missed once warmed up: run uncompiled rather than stall
        # a step on a compile (tests make it fail instead).
        self.unseen_step_stance = "eager_on_recompile"
        self._masks = self._step_masks
        # The layers each forward exports (indices into HF's `output_hidden_states`: an EAGLE head's), concatenated
        # into `exported` [B, n, len * H] for the step's body to return; none: nothing is recorded.
        self.export_layers: tuple[int, ...] = ()
        self.exported: torch.Tensor | None = None
        # Where a ragged step's padding tokens write (`step_forward` with `flattened`): the runner's scratch row;
        # the last ragged step's layout of its tokens in its rows ([B, n] token indices)
        self.fill_row = 0
        self.unflatten: torch.Tensor | None = None

    def compile_masks(self) -> None:
        """Compile the masks with the layers (`_step_masks`)."""
        self._masks = torch.compile(self._step_masks, dynamic=True)

    def stance(self) -> str:
        """How compiled code meets a kind of step it was not compiled for: compiles it until warmed up, then runs it
        uncompiled rather than stall a step (`unseen_step_stance`)."""
        return self.unseen_step_stance if self.warmed_up else "default"

    @torch.inference_mode()
    def warm_up(self, scratch_row: int, key_length: Callable[[int], int], paged_queries: int) -> None:
        """Compile every kind of step the compiled layers will see, before serving: one token or several, paged or
        gathered (to `key_length(tokens)` keys; paged up to `paged_queries` tokens), a prefill, batch 1, a few rows
        or many (each a separate compiled variant; sizes within a kind share one). Runs on `scratch_row`.
        Afterwards a step of a kind not seen here runs its layers uncompiled rather than stall a step on a compile
        (`eager_on_recompile`)."""
        start = time.perf_counter()

        def forward(batch: int, n: int, paged: bool) -> None:
            self.cache.lengths[scratch_row] = 0
            rows = torch.full((batch,), scratch_row, dtype=torch.long, device=self.device)
            input_ids = torch.zeros(batch, n, dtype=torch.long, device=self.device)
            num_valid = torch.full((batch,), n, dtype=torch.long, device=self.device)
            kv_len = None if paged else key_length(n)
            self.step_forward(rows, input_ids, num_valid, shape=StepShape(padded=batch, kv_len=kv_len), last_only=True)

        many = max(3, -(-FUSED_MIN_BLOCKS // self.cache.kv_heads))
        long = min(SHORT_QUERY + 1, self.cache.max_len)
        kinds = [(batch, n, False) for batch in (1, 2, many) for n in (1, 2, long)]
        kinds += [(batch, n, True) for batch in (1, 2, many) for n in (1, 2) if n <= paged_queries]
        for batch, n, paged in kinds:
            forward(batch, n, paged)
        self.cache.lengths[scratch_row] = 0
        self.warmed_up = True
        log.info("compiled layers warmed up for %d kinds of step in %.1f s", len(kinds), time.perf_counter() - start)

    @torch.inference_mode()
    def warm_up_ragged(self, scratch_row: int, width: int, kv_len: int | None) -> None:
        """With compiled layers, compile ragged verifies of up to `width` tokens a row (`step_forward` with
        `flattened`; `kv_len` as their step shape has it) at the batch sizes `warm_up` covers: TETRIS's, known
        only at a coordinator's Prepare, after `warm_up`."""
        warmed, self.warmed_up = self.warmed_up, False  # (compiles, not runs uncompiled, the kinds it meets)
        try:
            many = max(3, -(-FUSED_MIN_BLOCKS // self.cache.kv_heads))
            for batch, tokens in ((1, 1), (1, width), (2, width), (many, width)):  # (one token: specialised)
                self.cache.lengths[scratch_row] = 0
                rows = torch.full((batch,), scratch_row, dtype=torch.long, device=self.device)
                ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
                counts = torch.full((batch,), tokens, dtype=torch.long, device=self.device)
                shape = StepShape(padded=batch, kv_len=kv_len)
                self.step_forward(rows, ids, counts, shape=shape, last_only=False, flattened=batch * tokens)
        finally:
            self.warmed_up = warmed
            self.cache.lengths[scratch_row] = 0

    def step_forward(
        self,
        rows: torch.Tensor,
        input_ids: torch.Tensor,
        num_valid: torch.Tensor,
        *,
        shape: StepShape,
        last_only: bool = True,
        flattened: int | None = None,
        flat_logits: bool = False,
    ) -> torch.Tensor:
        """The forward proper, inside a step's body: appends `input_ids[b, :num_valid[b]]` to row `rows[b]` and
        returns the logits (`[B, n, V]`, or `[B, V]` at each row's last valid token when `last_only`) in
        `logits_dtype`. Free of host syncs, so that a CUDA graph can capture it.

        `flattened` (a ragged verify, design section 14): only the valid tokens run, as that many one-token virtual
        rows (at least `sum(num_valid)`; the rest pad, writing to `fill_row`); attention pads their queries back
        into their rows (`attention.RAGGED`), and the logits `[B, n, V]` past a row's valid tokens repeat its last
        valid one's; with `flat_logits` they stay `[flattened, V]`, which `[B, n]` indices `unflatten` lays out
        (a greedy verify's argmax over T rows, not B x n)."""
        batch, n = input_ids.shape
        # Before the cache is allocated (its probe) compiled code must not see it: eagerly.
        stance = self.stance() if self.cache.pool is not None else "force_eager"
        config = self.model.config
        own, config._attn_implementation = config._attn_implementation, self._attention
        try:
            with torch.compiler.set_stance(stance):
                starts = self.cache.lengths[rows]
                kwargs: dict[str, object] = {self._cache_kwarg: self.cache}
                mask: torch.Tensor | dict[str, torch.Tensor]
                if shape.kv_len is None:  # paged reads: the kernels mask by positions (and the layer's window)
                    positions = starts[:, None] + torch.arange(n, device=starts.device)
                    mask = positions.new_zeros(batch, 1, n, 1, dtype=self.dtype)
                    if self.mixed_layers:
                        mask = {"full_attention": mask, "sliding_attention": mask}
                    kwargs[PAGED] = (self.cache.tables, rows, positions, self.sliding_window is not None)
                else:
                    positions, full, windowed = self._masks(starts, n, shape.kv_len)
                    mask = full
                    if windowed is None:
                        kwargs[CAUSAL_BY_POSITIONS] = True
                    elif self.mixed_layers:
                        mask = {"full_attention": full, "sliding_attention": windowed}
                    else:
                        mask = windowed
                model_ids, model_positions, unflatten = input_ids, positions, None
                if flattened is None:
                    self.cache.select(rows, positions, kv_len=shape.kv_len)
                else:
                    layout = ragged_layout(rows, starts, num_valid, n, flattened, self.fill_row)
                    kwargs[RAGGED] = (layout.slots, batch, n, layout.begins, num_valid)
                    model_ids = input_ids.flatten()[layout.sources][:, None]
                    model_positions, unflatten = layout.positions, layout.unflatten
                    self.cache.select(layout.rows, model_positions, kv_len=shape.kv_len, read_rows=rows)
                if self.deterministic:
                    kwargs[DETERMINISTIC] = True
                if self.export_layers:
                    kwargs["output_hidden_states"] = True
                with invariant_mode(self.deterministic):
                    output = self.model.base_model(
                        input_ids=model_ids,
                        attention_mask=mask,
                        position_ids=model_positions,
                        use_cache=True,
                        **kwargs,
                    )
                hidden = output.last_hidden_state
                if self.export_layers:
                    self.exported = torch.cat([output.hidden_states[i] for i in self.export_layers], dim=-1)
                    if unflatten is not None:
                        self.exported = self.exported[:, 0][unflatten]
        finally:
            config._attn_implementation = own
        self.cache.lengths[rows] = starts + num_valid
        if last_only:
            hidden = hidden[torch.arange(batch, device=self.device), num_valid - 1]
        with invariant_mode(self.deterministic):
            logits = self.model.get_output_embeddings()(hidden).to(self.device)
        if self._softcap is not None:
            logits = torch.tanh(logits.float() / self._softcap) * self._softcap
        if unflatten is None:
            return logits
        self.unflatten = unflatten
        return logits[:, 0] if flat_logits else logits[:, 0][unflatten]

    def _step_masks(
        self, starts: torch.Tensor, n: int, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the positions of `n` new tokens after rows of lengths `starts`, the additive causal mask `[B, 1, n,
        kv_len]`, the same within the sliding window if the model has one). Compiled with the layers (`_masks`):
        eagerly it is about ten small kernels a step. Takes only tensors made inside the step: compiled code
        guards on whether its inputs are inference tensors, and callers' rows and ids may not be."""
        positions = starts[:, None] + torch.arange(n, device=starts.device)
        keys = torch.arange(kv_len, device=starts.device)
        causal = keys[None, None, :] <= positions[:, :, None]  # [B, n, kv_len]: committed + new, in order
        windowed = None
        if self.sliding_window is not None:
            windowed = self._additive(causal & (keys[None, None, :] > positions[:, :, None] - self.sliding_window))
        return positions, self._additive(causal), windowed

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """[B, n, kv] booleans -> the [B, 1, n, kv] additive mask that eager and SDPA attention both accept."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)[:, None]


@dataclass(slots=True)
class RaggedLayout:
    """A ragged step's rows' valid tokens as T one-token virtual rows (`ragged_layout`)."""

    rows: torch.Tensor  # [T] the cache row each token writes to (padding tokens: the fill row)
    positions: torch.Tensor  # [T, 1] its position there (padding: 0)
    sources: torch.Tensor  # [T] its index into the step's [B x n] inputs, flattened (padding: 0)
    slots: torch.Tensor  # [T] the same, padding B x n (`attention.RAGGED`)
    unflatten: torch.Tensor  # [B, n] the token each padded position takes its outputs from (past a row: its last)
    begins: torch.Tensor  # [B] each row's first token


def ragged_layout(
    rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int, total: int, fill_row: int
) -> RaggedLayout:
    """Rows `rows` of lengths `starts` appending `counts` (<= `width`, 0 allowed) tokens each as `total >=
    sum(counts)` virtual rows of one token, row after row; the rest pad. On the device, no host sync (a graph's
    shape is `total`)."""
    batch = len(rows)
    ends = counts.cumsum(0)
    begins = ends - counts
    token = torch.arange(total, device=rows.device)
    owner = torch.searchsorted(ends, token, right=True)  # (rows of no tokens are skipped: their ends are equal)
    valid = owner < batch
    owner = owner.clamp(max=batch - 1)
    offset = token - begins[owner]
    sources = owner * width + offset
    last = (begins + counts - 1).clamp(min=0)  # each row's last token (a row of none: any, its outputs unread)
    unflatten = torch.minimum(begins[:, None] + torch.arange(width, device=rows.device), last[:, None])
    return RaggedLayout(
        rows=torch.where(valid, rows[owner], fill_row),
        positions=torch.where(valid, starts[owner] + offset, 0)[:, None],
        sources=torch.where(valid, sources, 0),
        slots=torch.where(valid, sources, batch * width),
        unflatten=unflatten,
        begins=begins,
    )
