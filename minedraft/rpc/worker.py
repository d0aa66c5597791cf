"""The state a worker service holds: the loaded model, its runner, the channel, one compute thread."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from minedraft.channels import Channel, make_channel
from minedraft.channels.base import ReverseLayout
from minedraft.engine.model_runner import ModelRunner, model_context
from minedraft.engine.models import VocabInfo, checkpoint_vocab, load_model, load_tokenizer
from minedraft.engine.tensor_parallel import TensorParallel, rank_device
from minedraft.errors import ChannelNotSetUpError
from minedraft.proto import common_pb2
from minedraft.rpc.options import WorkerOptions
from minedraft.rpc.server_utils import Health

if TYPE_CHECKING:
    from transformers import PreTrainedModel

T = TypeVar("T")
# After a SIGTERM, what a server does before it stops; given an event that cuts it short (`ModelWorker.drain`)
Drain = Callable[[asyncio.Event], Awaitable[None]]
log = logging.getLogger(__name__)
PROFILED_CALLS = 5
NUM_BATCHES = 2  # the coordinator's alternating batches: each keeps its rows in graph buffers of its own
# A draining worker stops once no model call has come for this long: its coordinator has drained, or is gone.
QUIET_S = 5.0
# Work a call left for after its reply (`ModelWorker.after_reply`) waits at most this long for the reply to go out.
AFTER_REPLY_WAIT_S = 0.005


def precaptures(mode: str, device: torch.device, cuda_graphs: bool) -> bool:
    """Whether a worker runs its step shapes at the connect (--precapture-graphs): `auto` where CUDA graphs capture
    them; elsewhere nothing would be captured, and on a CPU every shape of a long cache takes minutes."""
    return mode == "on" or (mode == "auto" and device.type == "cuda" and cuda_graphs)


def host_id() -> str:
    """Two workers with the same host id can use CUDA IPC between them."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ModelWorker:
    """A model on its device with a paged KV cache for two batches; all model work runs on one thread, in order.

    Without a model (`vocab_from`: a drafter that reads no weights, n-gram lookup), it holds only the vocabulary of
    the checkpoint there and runs its work on the CPU; it then reports no KV blocks (nothing for the coordinator to
    account) and has no `runner`."""

    def __init__(
        self,
        options: WorkerOptions,
        tensor_parallel: TensorParallel | None = None,
        vocab_from: str | None = None,
        device: str = "cpu",
    ) -> None:
        """`tensor_parallel`: this process's rank of a group that shards the model (its device: `rank_device`)."""
        self.options = options
        self._model: PreTrainedModel | None = None
        self._runner: ModelRunner | None = None
        self.tokenizer: Any = None
        if vocab_from is not None:
            self.vocab, config = checkpoint_vocab(vocab_from)
            self._device = torch.device(device)  # (where a drafter of its own weights runs them: an EAGLE head)
            self.num_slots = 2 * options.max_batch_size
            context = model_context(config)
            self.max_len = min(options.max_model_len or context, context)
        else:
            self._load(options, tensor_parallel)
        self.channel: Channel | None = None
        # Its own CUDA stream: with target and draft in one process (`serve --single-process`) the two models'
        # kernels then overlap on the GPU instead of queueing on the default stream.
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model", initializer=self._on_device)
        # Work calls left for after their replies (`after_reply`), numbered in order; only the compute thread
        # touches it.
        self._later: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._numbers = itertools.count(1)
        self._unsent: dict[int, tuple[object, threading.Event]] = {}  # id(call) -> (call, set once it replied)
        self._calls = 0
        self._in_flight = 0
        self._last_call = time.monotonic()
        self._precaptured: set[tuple[int, int]] = set()  # (k, max batch size)

    def _load(self, options: WorkerOptions, tensor_parallel: TensorParallel | None) -> None:
        """The model, its vocabulary and its runner."""
        device = options.device if tensor_parallel is None else rank_device(options.device, tensor_parallel.rank)
        self._model = model = load_model(options.model, device, options.dtype, tensor_parallel)
        try:
            tokenizer = load_tokenizer(options.model)
        except ValueError:
            tokenizer = None  # a model directory without tokenizer files can still serve token ids
        self.tokenizer = tokenizer  # (a target's grammars are compiled for it)
        self.vocab = VocabInfo.of(model, tokenizer)
        # Two batches of max_batch_size each live here at once (batch-parallel decoding).
        self._runner = runner = ModelRunner(
            model,
            2 * options.max_batch_size,
            options.max_model_len,
            cuda_graphs=options.cuda_graphs,
            compile_layers=options.compile_layers,
            block_size=options.block_size,
            kv_cache_memory=options.kv_cache_memory,
            gpu_memory_utilization=options.gpu_memory_utilization,
            prefix_caching=options.prefix_caching,
            deterministic=options.deterministic,
        )
        self._device = runner.device
        self.num_slots, self.max_len = runner.num_slots, runner.max_len

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model(self) -> PreTrainedModel:
        if self._model is None:
            raise RuntimeError("this worker holds no model (a drafter without weights)")
        return self._model

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("this worker holds no model (a drafter without weights)")
        return self._runner

    @property
    def has_model(self) -> bool:
        return self._runner is not None

    @property
    def free_blocks(self) -> int:
        """KV blocks a sequence can take now (none without a model: nothing to account)."""
        return self._runner.free_blocks if self._runner is not None else 0

    @property
    def free_slots(self) -> int:
        return self._runner.free_slots if self._runner is not None else self.num_slots

    def _on_device(self) -> None:
        """The compute thread's current CUDA device is the model's, so that whatever CUDA work names no device (a
        graph's capture stream, a stream or event made without one) lands on the model's GPU, not on GPU 0; and its
        current stream is the worker's, set once rather than by a context around each call (whose device lookups
        rank high among a step's host calls)."""
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run model work on the compute thread, so the event loop keeps serving RPCs meanwhile."""
        return (await self.run_timed(fn, *args))[0]

    async def run_timed(self, fn: Callable[..., T], *args: object) -> tuple[T, float, float]:
        """`run`, and the seconds the work waited for the compute thread and ran on it (a call's reply reports
        both: time lost between the RPC and the model shows as the first)."""
        submitted = time.perf_counter()

        def timed() -> tuple[T, float, float]:
            started = time.perf_counter()
            self._run_later()
            result = self._on_stream(fn, *args)
            return result, started - submitted, elapsed(started)

        self._in_flight += 1
        for _, replied in list(self._unsent.values()):  # work left waits for no reply once another call comes
            replied.set()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, timed)
        finally:
            self._in_flight -= 1
            self._last_call = time.monotonic()

    def after_reply(self, call: object, work: Callable[[], None]) -> None:
        """On the compute thread, in the work of `call` (a request): `work` runs there once the call's reply has gone
        out (`replied`), another call comes, or AFTER_REPLY_WAIT_S pass, and in any case before the next call's
        work: host work the reply need not wait for. Waiting, the compute thread leaves the GIL to the event loop
        that sends the reply."""
        replied = threading.Event()
        self._unsent[id(call)] = (call, replied)
        number = next(self._numbers)
        self._later.append((number, work))

        def after() -> None:
            replied.wait(AFTER_REPLY_WAIT_S)
            self._unsent.pop(id(call), None)
            self._run_later(number)  # (what later calls left waits for their replies)

        self._executor.submit(after)

    def replied(self, call: object) -> None:
        """On the event loop: the reply to `call` has gone out (its `after_reply` work may run)."""
        unsent = self._unsent.pop(id(call), None)
        if unsent is not None:
            unsent[1].set()

    def _run_later(self, up_to: int | None = None) -> None:
        """Run the work calls left (`after_reply`), in order: all, or those left up to the `up_to`-th."""
        while self._later and (up_to is None or self._later[0][0] <= up_to):
            try:
                self._later.popleft()[1]()
            except Exception:  # (its call has replied: nothing to fail but a log line)
                log.exception("work left after a reply failed")

    async def drain(self, health_servicer: Health, cut_short: asyncio.Event) -> None:
        """After a SIGTERM, before the server stops: report NOT_SERVING (but to liveness probes: `Health.drain`) so
        that new connections go elsewhere, and keep serving until no model call has come for QUIET_S seconds,
        `drain_timeout` seconds pass or `cut_short` is set.

        When a whole release is deleted, every pod gets its SIGTERM at once: the coordinator's admitted requests
        still need both workers while it drains (up to its own `--drain-timeout`), and once they are done it sends
        nothing more. A worker replaced alone goes quiet the same way, as its coordinator follows its health: for a
        target it admits nothing new meanwhile; a draft it stops calling at once (the target decodes alone until the
        next draft serves), unless it is draining itself."""
        await health_servicer.drain()
        deadline = time.monotonic() + self.options.drain_timeout
        log.info(
            "draining: serving until no call has come for %.0f s, for up to %.0f s", QUIET_S, self.options.drain_timeout
        )
        while not cut_short.is_set():
            now = time.monotonic()
            if now >= deadline or (self._in_flight == 0 and now - self._last_call >= QUIET_S):
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cut_short.wait(), min(0.2, deadline - now))
        log.info("drained: %d model calls in flight", self._in_flight)

    def _on_stream(self, fn: Callable[..., T], *args: object) -> T:
        self._calls += 1
        first = self.options.profile_after + 1
        if self.options.profile_dir and first <= self._calls < first + PROFILED_CALLS:
            return self._profiled(fn, *args)
        return fn(*args)

    def _profiled(self, fn: Callable[..., T], *args: object) -> T:
        """One call under the PyTorch profiler, as `<call>_<pid>_<n>.json.gz` (Perfetto or chrome://tracing)."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.stream is not None:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            result = fn(*args)
            if self.stream is not None:
                self.stream.synchronize()
        wall = time.perf_counter() - start
        name = getattr(fn, "__name__", "call").lstrip("_")
        path = Path(str(self.options.profile_dir)) / f"{name}_{os.getpid()}_{self._calls}.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))  # gzipped by the profiler, from the name
        log.info("profiled call %d (%s, %.2f ms under the profiler) into %s", self._calls, name, wall * 1e3, path)
        return result

    def info(self) -> common_pb2.WorkerInfo:
        channels = ["local", "grpc", "nccl"]  # nccl runs over gloo on CPU
        if self.device.type == "cuda":
            channels.insert(0, "cuda-ipc")
        return common_pb2.WorkerInfo(
            model=self.options.model,
            device=str(self.device),
            host_id=host_id(),
            num_slots=self.num_slots,
            max_model_len=self.max_len,
            logits_size=self.vocab.logits_size,
            tokenizer_size=self.vocab.tokenizer_size,
            tokenizer_hash=self.vocab.tokenizer_hash,
            eos_token_ids=list(self.vocab.eos_token_ids),
            free_slots=self.free_slots,
            channels=channels,
            gpu_uuid=self.gpu_uuids[0] if self.gpu_uuids else "",
            gpu_uuids=self.gpu_uuids,
            block_size=self._runner.block_size if self._runner is not None else 0,
            num_blocks=self._runner.num_blocks if self._runner is not None else 0,
            free_blocks=self.free_blocks,
            prefix_caching=self._runner.cache.prefix_caching if self._runner is not None else False,
        )

    @functools.cached_property
    def gpu_uuids(self) -> list[str]:
        """The UUIDs of the GPUs the model's weights are on (this rank's: one)."""
        params = self._model.parameters() if self._model is not None else iter(())
        gpus = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
        return [str(torch.cuda.get_device_properties(gpu).uuid) for gpu in gpus]

    async def setup_channel(
        self,
        name: str,
        handshake: bytes,
        k: int,
        max_batch_size: int,
        exporter: bool,
        reverse: ReverseLayout | None = None,
        setup_timeout_s: float = 0.0,
    ) -> bytes:
        """A fresh channel in place of any earlier one. The draft side exports (returns a handshake; `reverse`: what
        the target sends back, if anything); the target side attaches to that handshake and returns what the reverse
        direction's `attach_back` needs (empty if nothing). `setup_timeout_s`: the rendezvous's bound (0: 120 s)."""
        await self.close_channel()
        channel = make_channel(name, self.device)
        if setup_timeout_s > 0:
            channel.setup_timeout_s = setup_timeout_s
        if exporter:
            reply = await self.run(channel.export, k, max_batch_size, self.vocab.logits_size, reverse)
        else:
            await self.run(channel.attach, handshake)
            reply = await self.run(channel.export_back)
        self.channel = channel
        return reply

    async def attach_channel_back(self, handshake: bytes) -> None:
        """The draft side's second set-up step: the reverse direction's end the target exported."""
        await self.run(self.require_channel().attach_back, handshake)

    async def close_channel(self, reason: str = "") -> None:
        """Close the channel (its peer is lost, or a fresh one replaces it), on the compute thread: after the calls
        queued there that may still use it. `reason`: said in the log, where the coordinator asked for it."""
        channel = self.channel
        if channel is None:
            return
        if reason:
            log.info("%s channel closed (%s)", channel.name, reason)

        def close() -> None:
            if self.channel is channel:
                self.channel = None
            channel.close()

        await self.run(close)

    async def prepare(self, precapture: Callable[[int, int], int], k: int, max_batch_size: int) -> None:
        """A coordinator's Prepare (or SetupChannel): with --precapture-graphs, `precapture(k, max_batch_size)` (the
        verifier's or proposer's) once for each k and batch size."""
        wanted = precaptures(self.options.precapture_graphs, self.device, self.options.cuda_graphs)
        if wanted and (k, max_batch_size) not in self._precaptured:
            await self.run(precapture, k, max_batch_size)
            self._precaptured.add((k, max_batch_size))

    def require_channel(self) -> Channel:
        if self.channel is None:
            raise ChannelNotSetUpError("no channel set up yet: the coordinator calls SetupChannel first")
        return self.channel


def elapsed(start: float) -> float:
    return time.perf_counter() - start
