"""CUDA graphs of a runner's short steps: batch buckets, capture as a chain of graphs, replay on static buffers."""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch

log = logging.getLogger(__name__)

# On CUDA batches of short steps are padded to these sizes (rows of padding write only to a scratch row): static
# shapes for CUDA graphs, and eager runs use the very same shapes, so graphs and eager give identical outputs.
# Prefills, never graphed, run at their own batch size.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_GRAPH_TOKENS = 16  # verify steps of up to 15 drafts (TETRIS: k + E); prefills run eagerly
# A step's graph is captured as a chain of graphs that begin at decoder-layer calls 1, 3, 7, 15, ... (0-based; each
# graph CHAIN_GROWTH times as many calls from the step's start as the one before): the GPU starts on the first while
# the host launches the rest (`CudaGraphs`). False: one graph per step.
SPLIT_LAUNCH = True
# Each hand-over between graphs of a chain left the GPU idle ~4.7 us (5 in an 8B verify). A faster growth means fewer
# of them, but each next graph must still launch while the ones before it run.
CHAIN_GROWTH = 2
# The BLAS library whose kernels steps' CUDA graphs capture. cuBLASLt chooses faster ones than cuBLAS for a verify's
# few-row GEMMs (the 8B verify 2.6-3.5% faster at B=8 and 16, the same at B=1, on an H200) but slower ones for
# prefills of thousands of rows (16 x 512 tokens 5% slower): eager forwards keep the process's choice.
GRAPH_BLAS = "cublaslt"
_CAPTURING = threading.Lock()  # held by the thread capturing a CUDA graph (`capturing`)

# (rows, per-row inputs) -> outputs: what a graph captures, run on its static buffers
GraphFn = Callable[[torch.Tensor, Sequence[torch.Tensor]], list[torch.Tensor]]
# A captured step: its chain of graphs, its input buffers, its outputs
Captured = tuple[list[torch.cuda.CUDAGraph], list[torch.Tensor], list[torch.Tensor]]


@contextlib.contextmanager
def capturing(device: torch.device) -> Iterator[None]:
    """Around a capture: one at a time per process, the garbage collector off. A graph that the collector destroys
    during a capture (one of a dropped runner's) invalidates that capture: seen on an H200. So collect first, and not
    during. (Cheap in a service: its start-up objects are frozen, see server_utils.start_server.) The collector's
    switch is process-wide, and two workers of one process (`serve --single-process`) prepare at once."""
    with _CAPTURING:
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            torch.cuda.synchronize(device)
            yield
        finally:
            if collecting:
                gc.enable()


def capture_graph(fn: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """`fn`, a few kernels on static tensors of `device`, as one graph of its own: run once on a side stream, then
    captured (thread-locally, `capturing`)."""
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(device), torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
    return graph


def padded_batch(batch: int) -> int:
    """The batch bucket a step of `batch` rows is padded to (itself beyond the largest bucket)."""
    return next((b for b in BATCH_BUCKETS if b >= batch), batch)


def ragged_tokens(batch: int, total: int, cuda: bool) -> int:
    """The flattened tokens a ragged verify of `batch` rows carrying `total` valid tokens runs (design section 14):
    on CUDA a multiple of its padded batch, so that its graphs are keyed by (batch bucket, tokens per row rounded
    up: 1..k + 1); elsewhere `total` itself (nothing is captured, nothing need pad)."""
    if not cuda:
        return total
    padded = padded_batch(batch)
    return padded * max(-(-total // padded), 1)


def graphable(tokens: int, last_only: bool) -> bool:
    """Whether a step of `tokens` per row runs as a CUDA graph: short steps, not prefills."""
    return not last_only and tokens <= MAX_GRAPH_TOKENS


class CudaGraphs:
    """Captured steps of one runner's model, keyed by (kind, forwards, padded batch, key length, the inputs' shapes):
    the runner's `Step.key`.

    Inputs are copied into static buffers before a replay; graphs of one input shape share them (replays never
    overlap: one runner, one stream), but each lane (the coordinator's batch) has its own buffer for the rows. A
    step's rows are copied only when they differ from those its buffer holds: a batch's rows repeat from step to
    step, and each copy costs
    the host ~17 us while the GPU waits for the launch. Padding rows hold `fill_row` (the runner's scratch row) and
    zero inputs. The returned outputs live in the graphs' shared memory pool and are valid until the next replay of
    any graph: one captured later may have its outputs where an earlier one keeps its intermediates (seen on an H200:
    a one-token step's logits overwritten by the next verify-sized replay).
    """

    def __init__(self, model: torch.nn.Module, layers: Sequence[torch.nn.Module], fill_row: int) -> None:
        """`layers`: the model's decoder layers, at whose calls a capture starts the chain's next graph."""
        self.device = next(model.parameters()).device
        self.fill_row = fill_row
        self.pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph's default capture stream is one per process, made on whichever device was current.
        self.capture_stream = torch.cuda.Stream(self.device)
        self.graphs: dict[tuple[object, ...], Captured] = {}
        self.buffers: dict[tuple[object, ...], torch.Tensor] = {}
        # A rows buffer's address -> the host rows last copied into it (and its padding filled): a batch's rows
        # repeat from step to step
        self.held: dict[int, torch.Tensor] = {}
        # Called at the start of each decoder layer's forward while set (a capture splits there). The hooks hold
        # this object weakly: graphs of runners made and dropped over one model must not stay alive through them.
        self.before_layer: Callable[[], None] | None = None
        graphs = weakref.ref(self)

        def before_layer(module: torch.nn.Module, args: object) -> None:
            hook = getattr(graphs(), "before_layer", None)
            if hook is not None:
                hook()

        hooks = [layer.register_forward_pre_hook(before_layer) for layer in layers]

        def remove_hooks() -> None:
            for hook in hooks:
                hook.remove()

        # Gone with this object: a model that outlives many runners (benchmarks, tests) would run every dead one's.
        weakref.finalize(self, remove_hooks)

    def run(
        self,
        key: tuple[object, ...],
        fn: GraphFn,
        inputs: list[torch.Tensor],
        *,
        padded: int,
        lane: int | None,
    ) -> list[torch.Tensor]:
        """Replay (capturing first) the graph of `key` on `inputs` (rows, then per-row inputs), padded to `padded`
        rows; `lane`: the coordinator's batch (its rows' buffer is its own, copied only when the rows changed)."""
        # Capture and replay happen on the runner's GPU whichever device is current in this thread (a graph
        # captured on another device's stream is empty: seen with target and draft on two GPUs of one process).
        with torch.cuda.device(self.device):
            batch = len(inputs[0])
            if key not in self.graphs:
                start = time.perf_counter()
                self.graphs[key] = self._capture(fn, inputs, padded=padded, lane=lane)
                log.info("captured a CUDA graph for %s in %.2f s", key, time.perf_counter() - start)
            graphs, static, outputs = self.graphs[key]
            self._copy_inputs(static, inputs, padded)
            for graph in graphs:
                graph.replay()
            return [t[:batch] for t in outputs]

    def _fill(self, position: int) -> int:
        """What the padding rows of input `position` hold: the fill row for the rows, zeros for the rest."""
        return self.fill_row if position == 0 else 0

    def _copy_inputs(self, static: list[torch.Tensor], inputs: list[torch.Tensor], padded: int) -> None:
        """Into a graph's input buffers: `inputs`, then the fills in the padding rows up to `padded`; the rows only
        where they differ from what their buffer holds."""
        batch = len(inputs[0])
        for position, (buffer, value) in enumerate(zip(static, inputs, strict=True)):
            if position == 0 and self._holds(buffer, value):
                continue
            buffer[:batch].copy_(value, non_blocking=True)  # host inputs straight in: one copy, no sync
            if batch < padded:
                buffer[batch:].fill_(self._fill(position))
            if position == 0 and not value.is_cuda:
                self.held[buffer.data_ptr()] = value.clone()
            else:
                self.held.pop(buffer.data_ptr(), None)

    def _holds(self, buffer: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether `buffer` holds the host tensor `value` already (torch.equal of two host tensors of a few dozen
        rows: ~2 us; a copy costs the host ~17 us while the GPU waits for the launch). (Not by identity and version:
        the inputs are inference tensors, which keep no version.)"""
        held = self.held.get(buffer.data_ptr())
        return not value.is_cuda and held is not None and held.shape == value.shape and torch.equal(held, value)

    def _capture(self, fn: GraphFn, inputs: list[torch.Tensor], *, padded: int, lane: int | None) -> Captured:
        # GRAPH_BLAS's kernels go into the graph (and its workspace is allocated in the warm-up, before the capture).
        # The switch is process-wide: in `serve --single-process` the other worker's prefill meanwhile may get them
        # too (a few % slower or faster).
        library = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(GRAPH_BLAS)
        try:
            return self._warm_and_capture(fn, inputs, padded=padded, lane=lane)
        finally:
            torch.backends.cuda.preferred_blas_library(library)

    def _warm_and_capture(self, fn: GraphFn, inputs: list[torch.Tensor], *, padded: int, lane: int | None) -> Captured:
        static = []
        for position, value in enumerate(inputs):
            shape = (padded, *value.shape[1:])
            # The rows' buffer is the lane's own (the rows repeat per batch); the others, among them a sampled
            # verify's draft probabilities (131 MB at B=64 over 128k), are shared.
            buffer_key = (position, shape, value.dtype, lane if position == 0 else None)
            if buffer_key not in self.buffers:
                self.buffers[buffer_key] = torch.empty(shape, dtype=value.dtype, device=self.device)
            static.append(self.buffers[buffer_key].fill_(self._fill(position)))  # every row the fill row's
        for buffer in static:  # (filled above)
            self.held.pop(buffer.data_ptr(), None)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs require; fill row only
            for _ in range(2):
                fn(static[0], static[1:])
        torch.cuda.current_stream(self.device).wait_stream(side)
        # A chain of graphs rather than one: launching a graph takes the host ~0.3 us a kernel (0.2 ms for an 8B
        # verify's ~600), and the GPU starts only at the launch's end. Each next graph of the chain is about as long
        # as all before it, so its launch runs while they do: the GPU waits only for the first (one layer's kernels).
        # They share the pool and always replay in capture order, so each finds the tensors the one before left.
        graphs = [torch.cuda.CUDAGraph()]
        layer_calls, next_start = 0, 2  # counted from 1: the second call begins the second graph

        def next_graph_as_it_grows() -> None:
            nonlocal layer_calls, next_start
            layer_calls += 1
            if layer_calls == next_start:
                next_start *= CHAIN_GROWTH
                graphs[-1].capture_end()
                graphs.append(torch.cuda.CUDAGraph())
                graphs[-1].capture_begin(self.pool, capture_error_mode="thread_local")

        # thread_local: another thread (the other model in a one-process PSD run) may use CUDA meanwhile.
        with capturing(self.device), torch.cuda.stream(self.capture_stream):
            graphs[0].capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                self.before_layer = next_graph_as_it_grows if SPLIT_LAUNCH else None
                outputs = fn(static[0], static[1:])
            finally:
                self.before_layer = None
                graphs[-1].capture_end()
        return graphs, static, outputs
