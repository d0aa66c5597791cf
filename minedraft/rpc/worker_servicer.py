"""The gRPC servicer the target and draft build on: their lifecycle RPCs, Prefill's checks, the step stream, serve."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from minedraft.channels.base import ReverseLayout
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import InvalidRequest
from minedraft.proto import common_pb2
from minedraft.rpc.lease import Leases, deployment_secret, presented
from minedraft.rpc.security import worker_credentials
from minedraft.rpc.server_utils import Health, grpc_errors, start_server, timings
from minedraft.rpc.step_stream import serve_step_stream
from minedraft.rpc.worker import NUM_BATCHES, Drain, ModelWorker

if TYPE_CHECKING:
    from minedraft.observability.metrics import WorkerMetrics
    from minedraft.rpc.ranks import RankGroup

Handler = TypeVar("Handler", bound=Callable[..., Any])

# Prompt lengths of the throwaway prefills run ahead of serving (`WorkerServicer.warm_up_prefill`): a short prompt
# and a long one take different kernels.
WARM_UP_PROMPT_LENGTHS = (17, 1000)
WARM_UP_SEQ_ID = 2**64 - 1  # and below: ids no coordinator reaches (they count up from 1)


def leased(handler: Handler) -> Handler:
    """An internal call's handler: served only under the worker's current lease (`Leases.check`), which it renews."""

    @functools.wraps(handler)
    async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        with self.leases.held(presented(context)):
            return await handler(self, request, context)

    return wrapped  # type: ignore[return-value]


class SequenceEngine(Protocol):
    """What the lifecycle RPCs ask of a worker's engine (the target's verifier, the draft's proposer)."""

    def release(self, seq_ids: Sequence[int]) -> None: ...

    def held_seq_ids(self) -> list[int]: ...

    def precapture(self, k: int, max_batch: int) -> int: ...


class WorkerServicer:
    """The RPCs a target and a draft serve alike, over a `ModelWorker` and its engine.

    Each service declares its own request and response for every RPC (buf's standard lint wants one per RPC), so
    requests arrive as the service's classes, field for field the same in both; a subclass names its reply classes
    and supplies what is its own: `prefill` on the compute thread, its step call (`step`, with Verify or Propose
    around it, and `step_stream` as VerifyStream or ProposeStream), `add_to` and, for the draft, `exports_channel`."""

    service_name: ClassVar[str]  # the service's full name, for health and reflection
    exports_channel: ClassVar[bool] = False  # the draft exports its end of the data plane; the target attaches to it
    GetInfoResponse: ClassVar[Callable[..., Message]]
    SetupChannelResponse: ClassVar[Callable[..., Message]]
    PrepareResponse: ClassVar[Callable[..., Message]]
    PrefillResponse: ClassVar[Callable[..., Message]]
    ReleaseResponse: ClassVar[Callable[..., Message]]
    LeaseResponse: ClassVar[Callable[..., Message]]
    StepStreamResponse: ClassVar[type[Message]]

    def __init__(self, worker: ModelWorker, engine: SequenceEngine, ranks: RankGroup | None = None) -> None:
        """`ranks`: the other tensor-parallel ranks of this worker, which `engine` hands its calls to."""
        self.worker = worker
        self.engine = engine
        self.ranks = ranks
        secret = deployment_secret(worker.options.lease_secret)
        self.leases = Leases(worker.options.lease_timeout, self._free_all, deployment_secret=secret)
        self.health: Health | None = None  # once serving

    def add_to(self, server: grpc.aio.Server) -> None:
        """Register this servicer with `server` (the service's generated `add_..._to_server`)."""
        raise NotImplementedError

    def prefill(
        self, seq_ids: list[int], prompts: list[list[int]], configs: list[SamplingConfig], request: Any = None
    ) -> dict[str, Any]:
        """On the compute thread: admit the sequences (`request`: the Prefill's, for what else it carries; None for
        a warm-up); returns the reply's fields other than its timings."""
        raise NotImplementedError

    async def before_prefill(self, configs: list[SamplingConfig]) -> None:
        """What a prefill's sequences need made off the compute thread first (the target's grammars)."""

    async def step(self, request: Any) -> Message:
        """The service's step call (Verify, Propose), which its unary handler and each message of its stream run."""
        raise NotImplementedError

    @grpc_errors
    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        return self.GetInfoResponse(info=self.worker.info())

    @grpc_errors
    async def Lease(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        ticket = presented(context)  # (its secret: the Lease call's own metadata carries it, as every call's does)
        secret = ticket.secret if ticket is not None else ""
        return self.LeaseResponse(lease=await self.leases.take(request.owner, request.epoch, request.give_up, secret))

    async def _free_all(self) -> int:
        """What a lease that ended held: every sequence, freed on the compute thread (after the calls queued there)."""
        held = await self.worker.run(self.engine.held_seq_ids)
        await self.worker.run(self.engine.release, held)
        return len(held)

    @grpc_errors
    @leased
    async def SetupChannel(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        if request.close:  # its peer is lost: free what the channel holds (a dead draft's GPU buffers, mapped here)
            await self.worker.close_channel("the coordinator lost its other end")
            return self.SetupChannelResponse()
        if request.attach_back:  # the second step: the reverse direction's end
            if not self.exports_channel:
                raise InvalidRequest("attach_back is the draft's second set-up step; the target never attaches back")
            await self.worker.attach_channel_back(request.handshake)
            return self.SetupChannelResponse()
        k, max_batch_size = request.num_speculative_tokens, request.max_batch_size
        if self.exports_channel:
            # Before the export (a no-op after Prepare): an nccl export waits (setup_timeout_s at most) for the
            # target, which attaches after this reply.
            await self.prepare(k, max_batch_size)
        handshake = await self.worker.setup_channel(
            request.channel,
            request.handshake,
            k,
            max_batch_size,
            self.exports_channel,
            self.reverse_layout(k, max_batch_size) if self.exports_channel else None,
            request.setup_timeout_s,
        )
        if not self.exports_channel:
            # After the attach (a no-op after Prepare): the draft's side of an nccl rendezvous is waiting for it.
            await self.prepare(k, max_batch_size)
        return self.SetupChannelResponse(handshake=handshake)

    def reverse_layout(self, k: int, max_batch_size: int) -> ReverseLayout | None:
        """The draft's: what it wants the target to send back over the channel (None: nothing)."""
        return None

    @grpc_errors
    @leased
    async def Prepare(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        await self.prepare(request.num_speculative_tokens, request.max_batch_size)
        return self.PrepareResponse()

    async def prepare(self, k: int, max_batch_size: int) -> None:
        """The step shapes run (with --precapture-graphs): each once, and a prefill."""
        await self.worker.prepare(self._ahead_of_serving, k, max_batch_size)

    def _ahead_of_serving(self, k: int, max_batch_size: int) -> int:
        shapes = self.engine.precapture(k, max_batch_size)
        self.warm_up_prefill()
        return shapes

    def warm_up_prefill(self) -> None:
        """Prefill and release throwaway sequences, outside the prefix cache: the one-time costs of a first prefill
        (kernels loaded at their first launch, cuBLAS plans) leave the first request (120 ms of an 8B target's first
        TTFT on an H200)."""
        if not self.worker.has_model:
            return
        runner = self.worker.runner
        pool = runner.cache.pool
        assert pool is not None
        room = pool.available * runner.cache.block_size // len(WARM_UP_PROMPT_LENGTHS) - runner.cache.block_size
        lengths = [n for n in WARM_UP_PROMPT_LENGTHS if n < min(runner.max_len, room)]
        if not lengths or runner.free_slots < len(lengths):
            return
        seq_ids = [WARM_UP_SEQ_ID - i for i in range(len(lengths))]
        prompts = [[i % self.worker.vocab.logits_size for i in range(n)] for n in lengths]
        caching, pool.prefix_caching = pool.prefix_caching, False
        try:
            self.prefill(seq_ids, prompts, [SamplingConfig(max_tokens=1)] * len(prompts))
        finally:
            pool.prefix_caching = caching
            self.engine.release(seq_ids)

    @grpc_errors
    @leased
    async def Prefill(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        start_unix = time.time()
        await self.release_first(request.release_seq_ids)
        seq_ids, prompts, configs = prefill_inputs(request.sequences, self.worker.vocab.logits_size)
        await self.before_prefill(configs)
        fields, queue_s, compute_s = await self.worker.run_timed(self.prefill, seq_ids, prompts, configs, request)
        timed = timings(start_unix, compute_s, queue_s=queue_s)
        return self.PrefillResponse(**fields, timings=timed, free_blocks=self.worker.free_blocks)

    async def step_stream(self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The step call's stream (VerifyStream, ProposeStream): each message a `step` of its own, under the lease the
        stream was opened with (one given up or expired since refuses it)."""
        ticket = presented(context)

        async def step(request: Any) -> Message:
            with self.leases.held(ticket):
                return await self.step(request)

        async for reply in serve_step_stream(requests, step, self.StepStreamResponse, self.worker.replied):
            yield reply

    async def release_first(self, seq_ids: Sequence[int]) -> None:
        """Releases riding on a call: applied before anything in the call can fail, so none is lost."""
        if seq_ids:
            await self.worker.run(self.engine.release, list(seq_ids))

    @grpc_errors
    @leased
    async def Release(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        await self.worker.run(self.engine.release, list(request.seq_ids))
        return self.ReleaseResponse(free_slots=self.worker.free_slots, free_blocks=self.worker.free_blocks)

    async def serve(
        self,
        port: int,
        host: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        metrics: WorkerMetrics | None,
    ) -> tuple[grpc.aio.Server, int, Drain]:
        """This service's gRPC server (health and reflection come too), its free slots on /metrics, and its drain
        after a SIGTERM (`ModelWorker.drain`)."""
        if metrics is not None and self.worker.has_model:
            runner = self.worker.runner
            pool = runner.cache.pool
            assert pool is not None
            metrics.free_slots.set_function(lambda: runner.free_slots)
            metrics.kv_blocks.set_function(lambda: pool.usable)
            metrics.kv_blocks_used.set_function(lambda: pool.used)
            metrics.kv_blocks_cached.set_function(lambda: pool.cached)
            metrics.kv_cache_usage.set_function(lambda: pool.used / pool.usable)
            metrics.prefix_queried.set_function(lambda: pool.stats.queried_tokens)
            metrics.prefix_hits.set_function(lambda: pool.stats.hit_tokens)
        health_servicer = self.health = Health()
        self._expiry = asyncio.create_task(self.leases.expire())  # (held: a task nothing references may vanish)
        tls = self.worker.options
        server, bound = await start_server(
            port,
            [self.add_to],
            [self.service_name],
            host,
            interceptors,
            health_servicer,
            credentials=worker_credentials(tls.tls_cert, tls.tls_key, tls.tls_ca),
        )
        if self.ranks is not None:  # a lost rank: NOT_SERVING at once (the watcher's thread hands it to the loop)
            loop = asyncio.get_running_loop()
            self.ranks.on_lost.append(
                lambda: asyncio.run_coroutine_threadsafe(health_servicer.enter_graceful_shutdown(), loop)
            )
        return server, bound, functools.partial(self.worker.drain, health_servicer)


def prefill_inputs(
    sequences: Sequence[common_pb2.SequenceSpec], logits_size: int
) -> tuple[list[int], list[list[int]], list[SamplingConfig]]:
    """A Prefill's sequence ids, prompts and sampling configs, checked: some sequences, none with an empty prompt,
    every token id one of the model's."""
    if not sequences:
        raise InvalidRequest("no sequences given")
    for spec in sequences:
        if not spec.prompt_token_ids:
            raise InvalidRequest(f"sequence {spec.seq_id} has an empty prompt")
        if spec.output_tokens >= len(spec.prompt_token_ids):
            raise InvalidRequest(f"sequence {spec.seq_id}: output_tokens must be fewer than its prompt's tokens")
    prompts = [list(s.prompt_token_ids) for s in sequences]
    if any(t < 0 or t >= logits_size for prompt in prompts for t in prompt):
        raise InvalidRequest(f"prompt token ids must be in [0, {logits_size})")
    configs = [SamplingConfig.from_proto(s.params, output_tokens=s.output_tokens) for s in sequences]
    return [s.seq_id for s in sequences], prompts, configs


def check_batch_id(batch_id: int) -> None:
    if not 0 <= batch_id < NUM_BATCHES:
        raise InvalidRequest(f"batch_id must be 0 or 1 (the coordinator's two batches), got {batch_id}")
