"""Forward passes of a causal LM over slot rows: steps prepared, then run as CUDA graphs or eagerly; compiled layers."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from minedraft.engine.attention import CAUSAL_BY_POSITIONS, FUSED_MIN_BLOCKS, GROUPED_SDPA, SHORT_QUERY
from minedraft.engine.cuda_graphs import CudaGraphs, graphable, padded_batch
from minedraft.engine.fused_projections import fuse_projections
from minedraft.engine.kv_cache import SlotKVCache
from minedraft.engine.residual_fold import fold_residuals
from minedraft.errors import CapacityError

log = logging.getLogger(__name__)


# Attention reads keys up to a multiple of this, so few distinct shapes occur (masks hide the extra entries).
KV_LEN_BUCKET = {"cpu": 64, "cuda": 256}


@dataclass(frozen=True)
class Arrangement:
    """A batch whose K/V fill cache rows `[start, start + B)`: taken in `order`, row b of the step is cache row
    start + b, so attention reads K/V as views (`ModelRunner.arrange`)."""

    start: int
    order: torch.Tensor | None = None  # indices putting the batch in cache-row order; None when it is already
    inverse: torch.Tensor | None = None  # indices putting a step's outputs back in the batch's order
    rows: torch.Tensor | None = None  # with `order`: the batch's rows in that order, on the host (a step's rows)


# Step and StepShape are made every step: not frozen, which takes four times as long to make.
@dataclass(slots=True)
class StepShape:
    """The static shape of a step, which its CUDA graph is captured for: the batch padded to its bucket (on CUDA,
    where it runs as a graph), the key length attention reads, and the block of cache rows whose K/V the batch reads
    as views (None: gathered)."""

    padded: int
    kv_len: int
    view_start: int | None = None


@dataclass(slots=True)
class Step:
    """One step on a batch, prepared (`ModelRunner.prepare`) and then run (`ModelRunner.run`)."""

    rows: torch.Tensor  # [B] the batch's cache rows (on the host or the device)
    inputs: tuple[torch.Tensor, ...]  # per-row inputs [B, ...] (on the host or the device); padding rows get zeros
    shape: StepShape
    graphable: bool  # a short step (not a prefill): padded, and on CUDA replayed from a graph
    # (kind, forwards, padded batch, key length, block start, each input's (shape[1:], dtype)): its graph's key
    key: tuple[object, ...]
    arrangement: Arrangement | None = None  # the batch in cache-row order (`ModelRunner.arrange`)


# (rows, per-row inputs, shape) -> outputs: what a step runs on its batch, padded and in cache-row order; on CUDA
# inside the step's graph, so it may read only its arguments and tensors that outlive the call, make no tensor from a
# Python value and never sync with the host. Its kind (`ModelRunner.prepare`) names what it does.
StepBody = Callable[[torch.Tensor, Sequence[torch.Tensor], StepShape], list[torch.Tensor]]
# (rows, needed, arrangement) -> anything: a step of a kind that serving runs, on scratch rows (`precapture`)
ScratchStep = Callable[[torch.Tensor, int, Arrangement | None], object]


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


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (transformers' layer base class), in order; empty for a model without them."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """`torch.compile` each decoder layer (in place, once per model): fused elementwise kernels inside the graphs.

    Compiled per layer rather than as a whole model: one compiled layer serves every layer of that kind, so warm-up
    costs a few compiles, not one per layer. For that the layer index is a dynamic int, which the cache write inside
    the compiled code takes as an index into stacked K/V (`SlotKVCache.update`). Shapes are dynamic: key-length
    buckets, batch buckets and prefill lengths reuse the same code.
    """
    if getattr(model, "_minedraft_compiled", False):
        return
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # Batch 1, one-token steps and several attention kinds each specialise: more variants than the default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    layers = decoder_layers(model)
    if not layers:
        log.warning("no decoder layers found in %s: running uncompiled", type(model).__name__)
    base = getattr(model, "base_model", model)
    # Each forward, not the module's call: hooks stay outside the compiled code (the runner's layer hook, which
    # splits a graph's capture, must run eagerly).
    folded = fold_residuals(base, layers)
    if not folded:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    # The base model's rotary embedding and final norm run once a step, outside the layers: a dozen small kernels
    # eagerly (the cosines and sines in float32, the norm's power, mean, rsqrt and products), one or two compiled.
    # In a draft's decode loop they are repeated every step, beside only a few layers.
    for name in ("rotary_emb",) if folded else ("rotary_emb", "norm"):
        module = getattr(base, name, None)
        if isinstance(module, torch.nn.Module):
            module.compile(dynamic=True)
    model._minedraft_compiled = True  # type: ignore[assignment]
    log.info(
        "compiling %d decoder layers of %s (each kind of step compiles on first use)", len(layers), type(model).__name__
    )


class ModelRunner:
    """Owns a model and its slot cache: allocates rows, prepares and runs steps that append tokens, rolls rows back."""

    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        max_len: int,
        cuda_graphs: bool = True,
        compile_layers: bool = False,
        groups: int = 1,
    ) -> None:
        """`groups`: batches that `arrange` gives a block of `num_slots // groups` cache rows each."""
        fuse_projections(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        limit = getattr(model.config, "max_position_embeddings", None) or max_len
        self.max_len = min(max_len, int(limit))
        self.num_slots = num_slots
        # One extra row that is never handed out: padding rows of a static-shape batch write there.
        self.scratch_row = num_slots
        spread = len({str(p.device) for p in model.parameters()}) > 1  # over several GPUs (load_model)
        layers = getattr(model.config.get_text_config(), "num_hidden_layers", None)
        self.cache = SlotKVCache(
            num_rows=num_slots + 1, max_len=self.max_len, device=self.device, num_layers=None if spread else layers
        )
        self.groups = groups
        self.block_size = num_slots // groups
        # Host copies of the cache's row map (logical row -> cache row) and of its inverse.
        self._cache_row = list(range(num_slots + 1))
        self._logical_row = list(range(num_slots + 1))
        # group -> (its rows, their arrangement) while no row has moved since: a batch's steps mostly repeat its rows
        self._arranged: dict[int, tuple[tuple[int, ...], Arrangement | None]] = {}
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._free = list(range(num_slots - 1, -1, -1))
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
        self.kv_bucket = KV_LEN_BUCKET["cuda" if self.device.type == "cuda" else "cpu"]
        # Our forwards use grouped SDPA; the model's own config is left as it is for anyone else calling it.
        own = getattr(model.config, "_attn_implementation", None)
        self._attention = GROUPED_SDPA if own == "sdpa" else own
        self.warmed_up = False  # compiled layers: every kind of step compiled (warm_up)
        # How compiled layers meet a kind of step the warm-up missed once warmed up: run uncompiled rather than stall
        # a step on a compile (tests make it fail instead).
        self.unseen_step_stance = "eager_on_recompile"
        # The static shape of every step run so far, as its CUDA graph's key (any device): what `precapture` must
        # cover.
        self.step_keys: set[tuple[object, ...]] = set()
        self.compiles = compile_layers
        self._masks = self._step_masks
        if compile_layers:
            compile_decoder_layers(model)
            self._masks = torch.compile(self._step_masks, dynamic=True)
        self.graphs: CudaGraphs | None = None
        if self.device.type == "cuda":
            # cuDNN's SDPA builds a new plan for every new key length: 17 ms of CPU per attention call measured on
            # an H200 (benchmarks/profile_step.py). The flash/efficient kernels take the same masks without that.
            torch.backends.cuda.enable_cudnn_sdp(False)
            # A graph is captured on one device's stream: a model spread over several GPUs runs eagerly.
            if cuda_graphs and not spread:
                self.graphs = CudaGraphs(model, decoder_layers(model), fill_row=self.scratch_row)
        if compile_layers:
            self.warm_up()

    # -- rows ---------------------------------------------------------------------------------------------------
    def regroup(self, groups: int) -> None:
        """Blocks for `groups` batches from now on, `num_slots // groups` cache rows each (`arrange`). Only while no
        row is held: its K/V sits in a block of the old layout."""
        if len(self._free) != self.num_slots:
            raise RuntimeError(
                f"cannot lay out {groups} batches while {self.num_slots - len(self._free)} rows are held"
            )
        self.groups, self.block_size = groups, self.num_slots // groups
        self._arranged.clear()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CapacityError(f"need {count} cache rows, {len(self._free)} free of {self.num_slots}")
        rows = [self._free.pop() for _ in range(count)]
        self.cache.lengths[rows] = 0
        return rows

    def release(self, rows: list[int]) -> None:
        self._free.extend(rows)

    def truncate(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll rows back to `lengths` committed tokens; later entries become invisible garbage."""
        self.cache.lengths[rows] = lengths

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every kind of step the compiled layers will see, before serving: one token or several, a prefill,
        batch 1, a few rows or many (each a separate compiled variant; sizes within a kind share one). Runs on the
        scratch row. Afterwards a step of a kind not seen here runs its layers uncompiled rather than stall a
        step on a compile (`eager_on_recompile`)."""
        start = time.perf_counter()

        def forward(batch: int, n: int, view: Arrangement | None) -> None:
            rows = self._scratch_rows(batch)
            input_ids = torch.zeros(batch, n, dtype=torch.long, device=self.device)
            num_valid = torch.full((batch,), n, dtype=torch.long, device=self.device)
            view_start = None if view is None else view.start
            shape = StepShape(padded=batch, kv_len=self.step_shape(batch, n)[1], view_start=view_start)
            self.step_forward(rows, input_ids, num_valid, shape=shape, last_only=True)

        # A first step allocates the cache (eagerly), whose K/V head count says how many rows make attention take
        # the fused kernel.
        if not self.cache.keys:
            forward(1, 1, None)
        many = max(3, -(-FUSED_MIN_BLOCKS // self.cache.kv_heads))
        # Batches read K/V as views (arrange); prefills gather theirs, short ones too. The strides differ, and so
        # does the code.
        kinds = [
            (batch, n, view)
            for batch in (1, 2, many)
            for n, view in ((1, True), (2, True), (2, False), (min(SHORT_QUERY + 1, self.max_len), False))
        ]
        for batch, n, view in kinds:
            forward(batch, n, self._block(0, batch) if view else None)
        self.cache.lengths[self.scratch_row] = 0
        self.warmed_up = True
        log.info("compiled layers warmed up for %d kinds of step in %.1f s", len(kinds), time.perf_counter() - start)

    def stance(self) -> str:
        """How compiled code meets a kind of step it was not compiled for: compiles it until warmed up, then runs it
        uncompiled rather than stall a step (`unseen_step_stance`)."""
        return self.unseen_step_stance if self.warmed_up else "default"

    def step_shape(self, batch: int, needed: int) -> tuple[int, int]:
        """(padded batch, key length) of a step on `batch` rows whose longest reaches `needed` tokens: the static
        shape a CUDA graph is captured for (batches are padded on CUDA only)."""
        return padded_batch(batch), min(-(-needed // self.kv_bucket) * self.kv_bucket, self.max_len)

    def _block(self, group: int, batch: int) -> Arrangement | None:
        """The block of cache rows that batch `group` of `batch` rows takes, if it fits with its padding."""
        start = group * self.block_size
        padded = padded_batch(batch) if self.device.type == "cuda" else batch
        if not 0 <= group < self.groups or batch > self.block_size or start + padded > self.num_slots + 1:
            return None
        return Arrangement(start)

    def arrange(self, rows: Sequence[int], group: int) -> Arrangement | None:
        """Move the K/V of logical `rows` (batch `group`) into its block of cache rows, so that the step reads them
        as views instead of gathering them (`SlotKVCache`: the gather was 8 of 19 ms of an 8B verify at batch 32); None
        if the batch does not fit.

        Rows already in the block stay: a membership change (a finished sequence, an admission, a rebalance) moves
        one row each, with the row that held its cache row in the block swapping out. The batch keeps its order;
        the step takes it in cache-row order (`Arrangement.order`). The same rows as the group's last step, with no
        row moved since, get that step's arrangement without a look (on an H200's host the look took 33 us of a
        B=1 verify's 250 before its graph's launch).
        """
        key = tuple(rows)
        last = self._arranged.get(group)
        if last is not None and last[0] == key:
            return last[1]
        arrangement = self._arrange(rows, group)
        self._arranged[group] = (key, arrangement)
        return arrangement

    @torch.inference_mode()
    def _arrange(self, rows: Sequence[int], group: int) -> Arrangement | None:
        block = self._block(group, len(rows))
        if block is None:
            return None
        start, end = block.start, block.start + len(rows)
        members = set(rows)
        vacant = [c for c in range(start, end) if self._logical_row[c] not in members]
        strays = [r for r in rows if not start <= self._cache_row[r] < end]
        if strays:
            free = set(self._free)
            sources, destinations, changed = [], [], []
            for row, cache_row in zip(strays, vacant, strict=True):
                other, old = self._logical_row[cache_row], self._cache_row[row]
                sources.append(old)
                destinations.append(cache_row)
                if other not in free:  # a live sequence (of the other batch, or not yet in one): swap
                    sources.append(cache_row)
                    destinations.append(old)
                self._cache_row[row], self._cache_row[other] = cache_row, old
                self._logical_row[cache_row], self._logical_row[old] = row, other
                changed += [row, other]
            self._arranged.clear()  # other groups' rows may have moved
            self.cache.move(sources, destinations)
            self.cache.physical[torch.tensor(changed, device=self.device)] = torch.tensor(
                [self._cache_row[r] for r in changed], device=self.device
            )
        offsets = [self._cache_row[r] - start for r in rows]
        if offsets == list(range(len(rows))):
            return block
        order = sorted(range(len(rows)), key=offsets.__getitem__)
        order_and_inverse = torch.tensor([order, offsets], device=self.device)  # one copy to the device
        return Arrangement(
            start, order=order_and_inverse[0], inverse=order_and_inverse[1], rows=torch.tensor([rows[i] for i in order])
        )

    @torch.inference_mode()
    def precapture(self, max_batch: int, n: int, run_step: ScratchStep, groups: Sequence[int] | None = None) -> int:
        """Run `run_step(rows, needed, arrangement)`, a step of `n` tokens, on the scratch row in every shape such a
        step on up to `max_batch` rows of batch `groups` (default: all) can take, so that CUDA captures its graphs
        before serving rather than while requests wait (0.2-0.5 s each, seen in the middle of a load on an H200).
        Returns the shapes run."""
        if self.device.type == "cuda" and self.graphs is None:  # --eager: nothing to capture
            return 0
        start = time.perf_counter()
        lengths = sorted({self.step_shape(1, needed)[1] for needed in range(n, self.max_len + 1)})
        if not self.cache.keys:  # the first forward allocates the cache, and runs eagerly
            run_step(self._scratch_rows(1), lengths[0], None)
        # Each batch's block has graphs of its own; a batch too big for its block with its padding gathers its rows.
        # (rows run, arrangement) per graph key; on CPUs, where nothing is padded, the fewest rows of that key.
        runs: dict[tuple[int, Arrangement | None], int] = {}
        for group in range(self.groups) if groups is None else groups:
            for batch in range(1, max_batch + 1):
                padded = padded_batch(batch)
                runs.setdefault((padded, self._block(group, batch)), padded if self.device.type == "cuda" else batch)
        for (_, view), rows in runs.items():
            for kv_len in lengths:
                run_step(self._scratch_rows(rows), kv_len, view)
        shapes = len(runs) * len(lengths)
        self.cache.lengths[self.scratch_row] = 0
        reserved = torch.cuda.memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        log.info(
            "ran %d step shapes (n=%d) ahead of serving in %.1f s; %.1f GiB of GPU memory reserved",
            shapes,
            n,
            time.perf_counter() - start,
            reserved,
        )
        return shapes

    def _scratch_rows(self, batch: int) -> torch.Tensor:
        """`batch` copies of the scratch row, emptied: the rows of a step run ahead of serving."""
        self.cache.lengths[self.scratch_row] = 0
        return torch.full((batch,), self.scratch_row, dtype=torch.long, device=self.device)

    # -- steps --------------------------------------------------------------------------------------------------
    def prepare(
        self,
        *,
        kind: str,
        rows: torch.Tensor,
        inputs: tuple[torch.Tensor, ...],
        needed: int,
        tokens: int,
        forwards: int = 1,
        last_only: bool = False,
        arrangement: Arrangement | None = None,
    ) -> Step:
        """A step of `kind` (what its body does: graphs are kept per kind) on `rows`, each appending `tokens` in its
        first forward, the longest reaching `needed`: checks capacity, picks the key-length bucket and the batch
        bucket, and keys its graph. `inputs` are per-row tensors `[B, ...]`; `forwards`: the forwards its body runs
        (a draft's decode loop: one per token); `last_only`: a prefill's (logits at each row's last token), which
        runs eagerly at its own batch size (a graph per prompt length would be captured mid-load, and padding
        would only add work: 39 prompts ran as 64); `arrangement` (from `arrange`) lets it read K/V as views."""
        if needed > self.max_len:
            raise CapacityError(f"a sequence would reach {needed} tokens, beyond the cache's {self.max_len}")
        padded, kv_len = self.step_shape(len(rows), needed)
        short = graphable(tokens, last_only)
        if not short:
            padded = len(rows)
        view_start = None if arrangement is None else arrangement.start
        key = (kind, forwards, padded, kv_len, view_start, *((tuple(t.shape[1:]), t.dtype) for t in inputs))
        shape = StepShape(padded=padded, kv_len=kv_len, view_start=view_start)
        return Step(rows=rows, inputs=inputs, shape=shape, graphable=short, key=key, arrangement=arrangement)

    @torch.inference_mode()
    def run(self, step: Step, body: StepBody, *, copy_outputs: bool = True) -> list[torch.Tensor]:
        """Run `body` on the step's rows and inputs, taken in cache-row order and, for a short step on CUDA, padded
        to its batch bucket (padding rows: the scratch row, zero inputs): its graph replayed (captured first), or
        eagerly with the very shapes a graph would have. Outputs come back in the batch's order, copied out of a
        graph's buffers (which the next replay of its shape rewrites) unless not `copy_outputs`.

        A verify's acceptance and commit are a few dozen small operations (148 launches from Python at batch 1): in
        the graph they cost no host time, and run without launch gaps (the verify 1% faster on an H200; they had
        mostly run while the forward's graph ran). So does whatever a body does before its forward (a verify
        gathers its pending tokens there): every operation before a graph's launch leaves the GPU idle, 30-40 us
        each on the H200 machine's host.
        """
        if step.graphable:
            self.step_keys.add(step.key)
        arrangement = step.arrangement
        if arrangement is not None and arrangement.order is not None:
            # The rows in that order as the arrangement made them, on the host: the same for every step of the batch.
            assert arrangement.rows is not None  # (`_arrange` makes both)
            inputs = [arrangement.rows, *(t.to(self.device, non_blocking=True)[arrangement.order] for t in step.inputs)]
        else:
            inputs = [step.rows, *step.inputs]
        outputs = self._launch(step, body, inputs)
        if arrangement is not None and arrangement.inverse is not None:
            return [t[arrangement.inverse] for t in outputs]  # (indexing copies)
        return [t.clone() for t in outputs] if copy_outputs else outputs

    def _launch(self, step: Step, body: StepBody, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`body` on `inputs` (the rows, then the per-row inputs, on the host or the device): the step's graph
        replayed where it has one, else eagerly."""
        shape = step.shape
        if self.device.type != "cuda":
            # As a graph's buffers and a padded batch are: inference tensors, which compiled code guards on.
            inputs = [t if t.is_inference() else t.clone() for t in inputs]
            return body(inputs[0], inputs[1:], shape)
        if self.graphs is not None and step.graphable and self.cache.keys:

            def graphed(rows: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
                self.cache.lengths.narrow(0, self.scratch_row, 1).zero_()  # padding rows begin empty, in the graph
                return body(rows, inputs, shape)

            try:
                return self.graphs.run(step.key, graphed, inputs, padded=shape.padded, block=shape.view_start)
            except RuntimeError as exc:  # a model whose forward cannot be captured still serves, eagerly
                log.warning("CUDA graph capture failed, running eagerly from now on: %s", exc)
                self.graphs = None
        # Eagerly, with the very shapes a graph would have, so both give identical outputs (prefills unpadded).
        batch = len(inputs[0])
        on_device = [t.to(self.device, non_blocking=True) for t in inputs]
        padded_inputs = (
            on_device
            if shape.padded == batch
            else [  # (prefills are not padded)
                torch.cat([t, t.new_full((shape.padded - batch, *t.shape[1:]), self.scratch_row if i == 0 else 0)])
                for i, t in enumerate(on_device)
            ]
        )
        self.cache.lengths[self.scratch_row] = 0
        return [t[:batch] for t in body(padded_inputs[0], padded_inputs[1:], shape)]

    @torch.inference_mode()
    def forward(
        self,
        rows: torch.Tensor,
        input_ids: torch.Tensor,
        num_valid: torch.Tensor,
        last_only: bool = False,
        needed: int | None = None,
        arrangement: Arrangement | None = None,
    ) -> torch.Tensor:
        """Append `input_ids[b, :num_valid[b]]` to row `rows[b]` and return float32 logits: one step of its own.

        Returns `[B, n, V]`, or `[B, V]` at each row's last valid token when `last_only` (prefill: the hidden
        states of long prompts are reduced before the vocabulary projection). `needed`, the longest row after this
        forward, spares the host sync that finds it when the caller knows it already.
        `arrangement` (from `arrange`) lets the step read K/V as views. On CUDA the logits may live in a graph's
        buffers, valid until the runner's next graphed step (`CudaGraphs`).
        """
        n = input_ids.shape[1]
        step = self.prepare(
            kind="forward",
            rows=rows,
            inputs=(input_ids, num_valid),
            needed=self.longest_after(rows, n) if needed is None else needed,
            tokens=n,
            last_only=last_only,
            arrangement=arrangement,
        )
        return self.run(step, self._last_logits if last_only else self._logits, copy_outputs=False)[0]

    def _logits(self, rows: torch.Tensor, inputs: Sequence[torch.Tensor], shape: StepShape) -> list[torch.Tensor]:
        """The body of a plain forward: its logits, in float32."""
        input_ids, num_valid = inputs
        return [self.step_forward(rows, input_ids, num_valid, shape=shape, last_only=False).float()]

    def _last_logits(self, rows: torch.Tensor, inputs: Sequence[torch.Tensor], shape: StepShape) -> list[torch.Tensor]:
        """The body of a plain prefill: its logits at each row's last valid token, in float32."""
        input_ids, num_valid = inputs
        return [self.step_forward(rows, input_ids, num_valid, shape=shape, last_only=True).float()]

    def longest_after(self, rows: torch.Tensor, n: int) -> int:
        """The longest of `rows` after appending `n` tokens each: a host sync, for callers that do not know it."""
        return int((self.cache.lengths[rows.to(self.device)] + n).max())

    def step_forward(
        self,
        rows: torch.Tensor,
        input_ids: torch.Tensor,
        num_valid: torch.Tensor,
        *,
        shape: StepShape,
        last_only: bool,
    ) -> torch.Tensor:
        """The forward proper, inside a step's body: appends `input_ids[b, :num_valid[b]]` to row `rows[b]` and
        returns the logits (`[B, n, V]`, or `[B, V]` at each row's last valid token when `last_only`) in
        `logits_dtype`. Free of host syncs, so that a CUDA graph can capture it."""
        batch = input_ids.shape[0]
        # The first forward allocates the cache: eagerly, or compiled code would be specialised on an empty one.
        stance = self.stance() if self.cache.keys else "force_eager"
        config = self.model.config
        own, config._attn_implementation = config._attn_implementation, self._attention
        try:
            with torch.compiler.set_stance(stance):
                starts = self.cache.lengths[rows]
                positions, full, windowed = self._masks(starts, input_ids.shape[1], shape.kv_len)
                mask: torch.Tensor | dict[str, torch.Tensor] = full
                if windowed is not None:
                    mask = {"full_attention": full, "sliding_attention": windowed} if self.mixed_layers else windowed
                self.cache.select(rows, positions, kv_len=shape.kv_len, view_start=shape.view_start)
                kwargs: dict[str, object] = {self._cache_kwarg: self.cache}
                if windowed is None:
                    kwargs[CAUSAL_BY_POSITIONS] = True
                hidden = self.model.base_model(
                    input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **kwargs
                ).last_hidden_state
        finally:
            config._attn_implementation = own
        self.cache.lengths[rows] = starts + num_valid
        if last_only:
            hidden = hidden[torch.arange(batch, device=self.device), num_valid - 1]
        logits = self.model.get_output_embeddings()(hidden).to(self.device)
        if self._softcap is not None:
            logits = torch.tanh(logits.float() / self._softcap) * self._softcap
        return logits

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
