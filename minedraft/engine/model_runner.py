"""Forward passes of a causal LM over a paged KV cache: steps prepared, then run as CUDA graphs or eagerly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from minedraft.engine.attention import avoid_cudnn_attention
from minedraft.engine.batch_invariant import fuse_norms, invariant_mode
from minedraft.engine.block_tables import TableWriter
from minedraft.engine.cache_sizing import allocate_cache
from minedraft.engine.cuda_graphs import CudaGraphs, graphable, padded_batch
from minedraft.engine.forward_pass import ForwardPass, StepShape, paged_queries
from minedraft.engine.fused_projections import FusedQKVAttention, fuse_projections
from minedraft.engine.kv_cache import PagedKVCache
from minedraft.engine.residual_fold import fold_residuals
from minedraft.engine.tensor_parallel import TensorParallel
from minedraft.errors import CapacityError

log = logging.getLogger(__name__)


# Attention reads keys up to a multiple of this, so few distinct shapes occur (masks hide the extra entries).
KV_LEN_BUCKET = {"cpu": 64, "cuda": 256}


def model_context(config: object) -> int:
    """The most tokens a sequence of the model may hold (its position embeddings; 2048 where the config has none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if value:
            return int(value)
    return 2048


# Made every step: not frozen, which takes four times as long to make.
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
        deterministic: bool = False,
    ) -> None:
        """`max_len`: tokens per sequence (None: the model's context); `kv_cache_memory`: GiB of K/V blocks (None:
        what `gpu_memory_utilization` of the GPU leaves after the weights, or `CPU_KV_CACHE_GIB` on a CPU);
        `deterministic`: each row's logits independent of the step's other rows and shape (`batch_invariant`)."""
        if deterministic and compile_layers:
            # Inductor picks its reductions' shapes (split or not) by size, and fuses the norms' means differently.
            log.warning("--deterministic runs the layers uncompiled: --compile is ignored")
            compile_layers = False
        fuse_projections(model)
        if deterministic:
            fuse_norms(model)
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
        self.forward_pass = ForwardPass(model, self.cache, deterministic)
        self.forward_pass.fill_row = self.scratch_row  # (a ragged step's padding tokens)
        # What a step's body calls, bound once: no call in between (`ForwardPass.step_forward`).
        self.step_forward = self.forward_pass.step_forward
        self.logits_dtype = self.forward_pass.logits_dtype
        self.kv_bucket = KV_LEN_BUCKET["cuda" if self.device.type == "cuda" else "cpu"]
        # The static shape of every step run so far, as its CUDA graph's key (any device): what `precapture` must
        # cover.
        self.step_keys: set[tuple[object, ...]] = set()
        self.compiles = compile_layers
        self.graphs: CudaGraphs | None = None
        avoid_cudnn_attention(self.device)
        allocate_cache(
            self.forward_pass,
            self.scratch_row,
            num_slots,
            self.tensor_parallel,
            kv_cache_memory,
            gpu_memory_utilization,
        )
        self.max_len = self.cache.max_len  # (lowered where one sequence would not fit)
        layers = decoder_layers(model)
        fused = [m for m in model.modules() if isinstance(m, FusedQKVAttention)]
        # On a CPU no kernel writes: each layer's rotary and write as transformers does them, at positions `select`
        # looks up once a forward (the operator's stand-in looked them up in every layer).
        self.cache.kernel_writes = (
            self.device.type == "cuda" and self.cache.stacked and len(layers) > 0 and len(fused) == len(layers)
        )
        self._paged_queries = paged_queries(model.config, self.cache, deterministic)
        if compile_layers:
            compile_decoder_layers(model)
            self.forward_pass.compile_masks()
        # A graph is captured on one device's stream: a model spread over several GPUs runs eagerly.
        if self.device.type == "cuda" and cuda_graphs and not spread:
            self.graphs = CudaGraphs(model, decoder_layers(model), fill_row=self.scratch_row)
            self.cache.table_writer = TableWriter(self.cache.apply_writes, self.device)
        if compile_layers:
            self.forward_pass.warm_up(self.scratch_row, self._key_length, self._paged_queries)

    # -- memory ---------------------------------------------------------------------------------------------------
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
        batches, needs = _precapture_plan(self.step_shape, self.max_len, max_batch, n, self.device.type == "cuda")
        for rows in batches:
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
        if last_only and kv_len is None and not self.forward_pass.deterministic:
            # A prefill gathers however few its tokens (a prompt's rest after cached blocks): the paged kernel would
            # compile a new variant for its query count at first use, 0.6-0.9 s mid-load on an H200. Not with
            # `--deterministic`: gathered, it runs `fixed_split_attention` (a loop over 64-key splits), and the
            # fixed paged kernel gives a position the bits its decodes and verifies give it. Its variants by query
            # count are few (Triton specializes counts of 1 and multiples of 16), each compiled at its first use.
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
        # The whole body under `--deterministic`'s mode: its sampling too (a lone row's cumsum)
        with invariant_mode(self.forward_pass.deterministic):
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


def _precapture_plan(
    step_shape: Callable[[int, int, int], tuple[int, int | None]], max_len: int, max_batch: int, n: int, cuda: bool
) -> tuple[list[int], list[int]]:
    """(rows, longest lengths) to run so that every graph key of an `n`-token step on up to `max_batch` rows is run
    once: a row count per batch bucket (on CPUs, where nothing is padded, the fewest rows of that bucket) and a
    length per key-length bucket."""
    lengths = sorted({(needed, step_shape(1, needed, n)[1]) for needed in range(n, max_len + 1)})
    needs = list({kv_len: needed for needed, kv_len in lengths}.values())
    batches: dict[int, int] = {}
    for batch in range(1, max_batch + 1):
        batches.setdefault(padded_batch(batch), padded_batch(batch) if cuda else batch)
    return list(batches.values()), needs
