"""Forward passes of a causal LM over a paged KV cache: steps prepared, then run as CUDA graphs or eagerly."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from minedraft.engine.attention import (
    CAUSAL_BY_POSITIONS,
    FUSED_MIN_BLOCKS,
    GROUPED_SDPA,
    PAGED,
    SHORT_QUERY,
    paged_kernel,
)
from minedraft.engine.block_tables import TableWriter
from minedraft.engine.cuda_graphs import CudaGraphs, graphable, padded_batch
from minedraft.engine.fused_projections import FusedQKVAttention, fuse_projections
from minedraft.engine.kv_cache import PagedKVCache
from minedraft.engine.residual_fold import fold_residuals
from minedraft.engine.tensor_parallel import TensorParallel, same_on_every_rank
from minedraft.errors import CapacityError

log = logging.getLogger(__name__)


# Attention reads keys up to a multiple of this, so few distinct shapes occur (masks hide the extra entries).
KV_LEN_BUCKET = {"cpu": 64, "cuda": 256}
# The KV cache of a worker on a CPU, by default (`--kv-cache-memory`): a laptop's share.
CPU_KV_CACHE_GIB = 1.0
# GPU memory kept out of the KV cache for what a step allocates beside it (activations, CUDA graphs' pools).
ACTIVATION_RESERVE_GIB = 2.0


def model_context(config: object) -> int:
    """The most tokens a sequence of the model may hold (its position embeddings; 2048 where the config has none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if value:
            return int(value)
    return 2048


def kv_cache_bytes(device: torch.device, kv_cache_memory: float | None, gpu_memory_utilization: float) -> int:
    """The bytes of K/V blocks a worker allocates: `kv_cache_memory` GiB; or on a GPU what `gpu_memory_utilization`
    of its memory leaves once this process's weights are in (never more than is free now, less a reserve for
    activations); or `CPU_KV_CACHE_GIB`."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory * 2**30)
    if device.type != "cuda":
        return int(CPU_KV_CACHE_GIB * 2**30)
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    budget = min(gpu_memory_utilization * total - own, free) - ACTIVATION_RESERVE_GIB * 2**30
    return max(int(budget), 0)


# Step and StepShape are made every step: not frozen, which takes four times as long to make.
@dataclass(slots=True)
class StepShape:
    """The static shape of a step, which its CUDA graph is captured for: the batch padded to its bucket (on CUDA,
    where it runs as a graph) and the key length attention reads gathered (None: paged reads through the block
    tables, bounded by each row's own length)."""

    padded: int
    kv_len: int | None


@dataclass(slots=True)
class Step:
    """One step on a batch, prepared (`ModelRunner.prepare`) and then run (`ModelRunner.run`)."""

    rows: torch.Tensor  # [B] the batch's cache rows (on the host or the device)
    inputs: tuple[torch.Tensor, ...]  # per-row inputs [B, ...] (on the host or the device); padding rows get zeros
    shape: StepShape
    graphable: bool  # a short step (not a prefill): padded, and on CUDA replayed from a graph
    # (kind, forwards, padded batch, key length, each input's (shape[1:], dtype)): its graph's key
    key: tuple[object, ...]
    lane: int | None = None  # the coordinator's batch: graphs keep its rows in a buffer of its own


# (rows, per-row inputs, shape) -> outputs: what a step runs on its batch, padded and in cache-row order; on CUDA
# inside the step's graph, so it may read only its arguments and tensors that outlive the call, make no tensor from a
# Python value and never sync with the host. Its kind (`ModelRunner.prepare`) names what it does.
StepBody = Callable[[torch.Tensor, Sequence[torch.Tensor], StepShape], list[torch.Tensor]]
# (rows, needed) -> anything: a step of a kind that serving runs, on scratch rows (`precapture`)
ScratchStep = Callable[[torch.Tensor, int], object]


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
    the compiled code takes as an index into stacked K/V (`PagedKVCache.write`). Shapes are dynamic: key-length
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
    """Owns a model and its paged KV cache: rows for sequences, blocks for their tokens, steps that append tokens."""

    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        max_len: int | None = None,
        cuda_graphs: bool = True,
        compile_layers: bool = False,
        *,
        block_size: int = 16,
        kv_cache_memory: float | None = None,
        gpu_memory_utilization: float = 0.9,
        prefix_caching: bool = True,
    ) -> None:
        """`max_len`: tokens per sequence (None: the model's context); `kv_cache_memory`: GiB of K/V blocks (None:
        what `gpu_memory_utilization` of the GPU leaves after the weights, or `CPU_KV_CACHE_GIB` on a CPU)."""
        fuse_projections(model)
        self.model = model
        self.tensor_parallel: TensorParallel | None = getattr(model, "_minedraft_tp", None)  # (`shard_model`)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        limit = model_context(model.config)
        self.max_len = min(max_len or limit, limit)
        self.num_slots = num_slots
        # One extra row that is never handed out: padding rows of a static-shape batch write there (to the trash
        # block: its table points nowhere else).
        self.scratch_row = num_slots
        spread = len({str(p.device) for p in model.parameters()}) > 1  # over several GPUs (load_model)
        self.cache = PagedKVCache(num_slots + 1, self.max_len, block_size, self.device, prefix_caching)
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
        self.graphs: CudaGraphs | None = None
        if self.device.type == "cuda":
            # cuDNN's SDPA builds a new plan for every new key length: 17 ms of CPU per attention call measured on
            # an H200 (benchmarks/profile_step.py). The flash/efficient kernels take the same masks without that.
            torch.backends.cuda.enable_cudnn_sdp(False)
        self._allocate_cache(kv_cache_memory, gpu_memory_utilization)
        layers = decoder_layers(model)
        fused = [m for m in model.modules() if isinstance(m, FusedQKVAttention)]
        # On a CPU no kernel writes: each layer's rotary and write as transformers does them, at positions `select`
        # looks up once a forward (the operator's stand-in looked them up in every layer).
        self.cache.kernel_writes = (
            self.device.type == "cuda" and self.cache.stacked and len(layers) > 0 and len(fused) == len(layers)
        )
        # Short steps read K/V through the block tables where the Triton kernels take the model's attention: then
        # neither they nor their graphs depend on the key length.
        text = model.config.get_text_config()
        heads = int(getattr(text, "num_attention_heads", 1))
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)  # (the ratio a rank's shard keeps too)
        self._paged_queries = (
            SHORT_QUERY // max(heads // kv_heads, 1)
            if self.device.type == "cuda" and paged_kernel(self.cache.specs or [], text)
            else 0
        )
        if compile_layers:
            compile_decoder_layers(model)
            self._masks = torch.compile(self._step_masks, dynamic=True)
        # A graph is captured on one device's stream: a model spread over several GPUs runs eagerly.
        if self.device.type == "cuda" and cuda_graphs and not spread:
            self.graphs = CudaGraphs(model, decoder_layers(model), fill_row=self.scratch_row)
            self.cache.table_writer = TableWriter(self.cache.apply_writes, self.device)
        if compile_layers:
            self.warm_up()

    # -- memory ---------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _allocate_cache(self, kv_cache_memory: float | None, gpu_memory_utilization: float) -> None:
        """Probe the K/V each token caches, then allocate the blocks once, before serving; lowers `max_len` (with a
        log line) where one sequence would not fit."""
        self.cache.probe()
        try:
            rows = self._scratch_rows(1)
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            self.step_forward(rows, ids, torch.ones(1, dtype=torch.long, device=self.device), shape=StepShape(1, 1))
        finally:
            self.cache.end_probe()
        self.cache.lengths[self.scratch_row] = 0
        per_block = self.cache.bytes_per_block
        budget = kv_cache_bytes(self.device, kv_cache_memory, gpu_memory_utilization)
        ever_needed = self.num_slots * self.cache.max_blocks + 1  # every row at max_len, and the trash block
        # Every rank of a tensor-parallel group holds as many blocks: each then takes and frees the very same ones.
        num_blocks = same_on_every_rank(min(budget // per_block, ever_needed), self.tensor_parallel, self.device)
        if num_blocks < 2:
            raise CapacityError(
                f"{budget / 2**30:.2f} GiB of KV cache holds no block of {per_block / 2**20:.1f} MiB: raise "
                "--kv-cache-memory or --gpu-memory-utilization"
            )
        self.cache.allocate(int(num_blocks))
        fits = (int(num_blocks) - 1) * self.cache.block_size
        if fits < self.max_len:
            log.warning(
                "max_model_len lowered from %d to %d tokens: one sequence must fit the KV cache's %d blocks",
                self.max_len,
                fits,
                num_blocks - 1,
            )
            self.max_len = self.cache.max_len = fits
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB) on %s; max_model_len %d",
            num_blocks - 1,
            self.cache.block_size,
            (num_blocks - 1) * self.cache.block_size,
            num_blocks * per_block / 2**30,
            self.device,
            self.max_len,
        )

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks sequences can hold."""
        assert self.cache.pool is not None
        return self.cache.pool.usable

    @property
    def free_blocks(self) -> int:
        """Blocks a sequence can take now (free, or cached and held by no one)."""
        assert self.cache.pool is not None
        return self.cache.pool.available

    # -- rows ---------------------------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise CapacityError(f"need {count} sequence rows, {len(self._free)} free of {self.num_slots}")
        rows = [self._free.pop() for _ in range(count)]
        self.cache.lengths[rows] = 0
        return rows

    def release(self, rows: list[int]) -> None:
        self.cache.release(rows)
        self._free.extend(rows)

    def truncate(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll rows back to `lengths` committed tokens, on the device (inside a step's graph); the blocks left
        empty go back once the host knows the lengths (`PagedKVCache.trim`)."""
        self.cache.lengths[rows] = lengths

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every kind of step the compiled layers will see, before serving: one token or several, paged or
        gathered, a prefill, batch 1, a few rows or many (each a separate compiled variant; sizes within a kind share
        one). Runs on the scratch row. Afterwards a step of a kind not seen here runs its layers uncompiled rather
        than stall a step on a compile (`eager_on_recompile`)."""
        start = time.perf_counter()

        def forward(batch: int, n: int, paged: bool) -> None:
            rows = self._scratch_rows(batch)
            input_ids = torch.zeros(batch, n, dtype=torch.long, device=self.device)
            num_valid = torch.full((batch,), n, dtype=torch.long, device=self.device)
            kv_len = None if paged else self._key_length(n)
            self.step_forward(rows, input_ids, num_valid, shape=StepShape(padded=batch, kv_len=kv_len), last_only=True)

        many = max(3, -(-FUSED_MIN_BLOCKS // self.cache.kv_heads))
        long = min(SHORT_QUERY + 1, self.max_len)
        kinds = [(batch, n, False) for batch in (1, 2, many) for n in (1, 2, long)]
        kinds += [(batch, n, True) for batch in (1, 2, many) for n in (1, 2) if n <= self._paged_queries]
        for batch, n, paged in kinds:
            forward(batch, n, paged)
        self.cache.lengths[self.scratch_row] = 0
        self.warmed_up = True
        log.info("compiled layers warmed up for %d kinds of step in %.1f s", len(kinds), time.perf_counter() - start)

    def stance(self) -> str:
        """How compiled code meets a kind of step it was not compiled for: compiles it until warmed up, then runs it
        uncompiled rather than stall a step (`unseen_step_stance`)."""
        return self.unseen_step_stance if self.warmed_up else "default"

    def step_shape(self, batch: int, needed: int, tokens: int) -> tuple[int, int | None]:
        """(padded batch, key length) of a step on `batch` rows of `tokens` new tokens each whose longest reaches
        `needed`: the static shape a CUDA graph is captured for (batches are padded on CUDA only). The key length is
        None where attention reads the blocks through the tables (`PagedKVCache`), else a bucket."""
        return padded_batch(batch), None if tokens <= self._paged_queries else self._key_length(needed)

    def _key_length(self, needed: int) -> int:
        """The key-length bucket of a gathered step whose longest row reaches `needed`."""
        return min(-(-needed // self.kv_bucket) * self.kv_bucket, self.max_len)

    @torch.inference_mode()
    def precapture(self, max_batch: int, n: int, run_step: ScratchStep) -> int:
        """Run `run_step(rows, needed)`, a step of `n` tokens, on the scratch row in every shape such a step on up
        to `max_batch` rows can take, so that CUDA captures its graphs before serving rather than while requests
        wait (0.2-0.5 s each, seen in the middle of a load on an H200). Paged steps have one shape per batch bucket
        whatever `max_len`; gathered ones one per key-length bucket too. Returns the shapes run."""
        if self.device.type == "cuda" and self.graphs is None:  # --eager: nothing to capture
            return 0
        start = time.perf_counter()
        lengths = sorted({(needed, self.step_shape(1, needed, n)[1]) for needed in range(n, self.max_len + 1)})
        needs = list({kv_len: needed for needed, kv_len in lengths}.values())
        # The rows run per graph key; on CPUs, where nothing is padded, the fewest rows of that key.
        batches: dict[int, int] = {}
        for batch in range(1, max_batch + 1):
            batches.setdefault(padded_batch(batch), padded_batch(batch) if self.device.type == "cuda" else batch)
        for rows in batches.values():
            for needed in needs:
                run_step(self._scratch_rows(rows), needed)
        shapes = len(batches) * len(needs)
        self.cache.lengths[self.scratch_row] = 0
        reserved = torch.cuda.memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else 0.0
        log.info(
            "ran %d step shapes (n=%d) ahead of serving in %.2f s; %.1f GiB of GPU memory reserved",
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
        lane: int | None = None,
    ) -> Step:
        """A step of `kind` (what its body does: graphs are kept per kind) on `rows`, each appending `tokens` in its
        first forward, the longest reaching `needed`: checks the length, picks the batch bucket (and a key-length
        bucket where attention gathers), and keys its graph. `inputs` are per-row tensors `[B, ...]`; `forwards`: the
        forwards its body runs (a draft's decode loop: one per token); `last_only`: a prefill's (logits at each row's
        last token), which gathers its keys and runs eagerly at its own batch size (a graph per prompt length would be
        captured mid-load, and padding would only add work: 39 prompts ran as 64); `lane`: the coordinator's batch
        (`Step.lane`). The rows' blocks must be reserved (`PagedKVCache.reserve`)."""
        if needed > self.max_len:
            raise CapacityError(f"a sequence would reach {needed} tokens, beyond max_model_len {self.max_len}")
        short = graphable(tokens, last_only)
        padded, kv_len = self.step_shape(len(rows), needed, tokens)
        if not short:
            padded = len(rows)
        if last_only and kv_len is None:
            # A prefill gathers however few its tokens (a prompt's rest after cached blocks): the paged kernel would
            # compile a new variant for its query count at first use, 0.6-0.9 s mid-load on an H200.
            kv_len = self._key_length(needed)
        key = (kind, forwards, padded, kv_len, *((tuple(t.shape[1:]), t.dtype) for t in inputs))
        shape = StepShape(padded=padded, kv_len=kv_len)
        return Step(rows=rows, inputs=inputs, shape=shape, graphable=short, key=key, lane=lane)

    @torch.inference_mode()
    def run(self, step: Step, body: StepBody, *, copy_outputs: bool = True) -> list[torch.Tensor]:
        """Run `body` on the step's rows and inputs, for a short step on CUDA padded to its batch bucket (padding
        rows: the scratch row, zero inputs): its graph replayed (captured first), or eagerly with the very shapes a
        graph would have. Outputs are copied out of a graph's buffers (which the next replay of its shape rewrites)
        unless not `copy_outputs`.

        A verify's acceptance and commit are a few dozen small operations (148 launches from Python at batch 1): in
        the graph they cost no host time, and run without launch gaps (the verify 1% faster on an H200; they had
        mostly run while the forward's graph ran). So does whatever a body does before its forward (a verify
        gathers its pending tokens there): every operation before a graph's launch leaves the GPU idle, 30-40 us
        each on the H200 machine's host.
        """
        if step.graphable:
            self.step_keys.add(step.key)
        outputs = self._launch(step, body, [step.rows, *step.inputs])
        return [t.clone() for t in outputs] if copy_outputs else outputs

    def _launch(self, step: Step, body: StepBody, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """`body` on `inputs` (the rows, then the per-row inputs, on the host or the device): the step's graph
        replayed where it has one, else eagerly."""
        shape = step.shape
        if self.device.type != "cuda":
            self.cache.flush()
            # As a graph's buffers and a padded batch are: inference tensors, which compiled code guards on.
            inputs = [t if t.is_inference() else t.clone() for t in inputs]
            return body(inputs[0], inputs[1:], shape)
        if self.graphs is not None and step.graphable:
            # Blocks the rows took for this step, where the step before did not take them ahead (`keep_ahead`).
            self.cache.flush(freed=False)

            def graphed(rows: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
                self.cache.lengths.narrow(0, self.scratch_row, 1).zero_()  # padding rows begin empty, in the graph
                return body(rows, inputs, shape)

            try:
                return self.graphs.run(step.key, graphed, inputs, padded=shape.padded, lane=step.lane)
            except RuntimeError as exc:  # a model whose forward cannot be captured still serves, eagerly
                log.warning("CUDA graph capture failed, running eagerly from now on: %s", exc)
                self.graphs = None
        self.cache.flush()
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
    ) -> torch.Tensor:
        """Append `input_ids[b, :num_valid[b]]` to row `rows[b]` and return float32 logits: one step of its own,
        its blocks reserved first.

        Returns `[B, n, V]`, or `[B, V]` at each row's last valid token when `last_only` (prefill: the hidden
        states of long prompts are reduced before the vocabulary projection). `needed`, the longest row after this
        forward, spares the host sync that finds it when the caller knows it already. On CUDA the logits may live in
        a graph's buffers, valid until the runner's next graphed step (`CudaGraphs`).
        """
        n = input_ids.shape[1]
        host_rows = rows.tolist()
        ends = (self.cache.lengths[rows.to(self.device)] + n).clamp(max=self.max_len).tolist()  # padding too
        self.cache.reserve(host_rows, ends)
        step = self.prepare(
            kind="forward",
            rows=rows,
            inputs=(input_ids, num_valid),
            needed=self.longest_after(rows, n) if needed is None else needed,
            tokens=n,
            last_only=last_only,
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
        last_only: bool = True,
    ) -> torch.Tensor:
        """The forward proper, inside a step's body: appends `input_ids[b, :num_valid[b]]` to row `rows[b]` and
        returns the logits (`[B, n, V]`, or `[B, V]` at each row's last valid token when `last_only`) in
        `logits_dtype`. Free of host syncs, so that a CUDA graph can capture it."""
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
                self.cache.select(rows, positions, kv_len=shape.kv_len)
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
