"""The public GenerationService: validation, tokenization, admission, streaming; wires workers and channel."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.batch_manager import BatchManager, QueueFullError
from coordinator.request_state import RequestState
from coordinator.step_loop import StepLoop, Unavailable
from coordinator.tracing import TracedStepLoop, TracedWorkers
from coordinator.validation import prompt_token_ids, sampling_config
from coordinator.workers import Workers
from minedraft.engine.models import VocabInfo, check_pair, load_tokenizer
from minedraft.errors import ModelLoadError
from minedraft.observability.metrics import CoordinatorMetrics, finish_reason_name
from minedraft.observability.telemetry import Tracing, end_request_span, start_request_span
from minedraft.proto import common_pb2, draft_pb2, generation_pb2, generation_pb2_grpc, target_pb2
from minedraft.rpc.server_utils import Health, start_server

log = logging.getLogger(__name__)
GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


@dataclass
class CoordinatorOptions:
    target: str
    draft: str | None
    mode: str = "psd"
    num_speculative_tokens: int = 4
    max_batch_size: int = 32
    max_queue_size: int = 256
    max_prefill_tokens: int = 8192  # prompt tokens per step's prefill (0: no limit), `BatchManager`
    channel: str = "auto"
    tokenizer: str | None = None
    step_trace: str | None = None
    overlap: str = "auto"  # psd: run Verify and Propose concurrently always, never, or when it measures faster
    speculation: str = "auto"  # psd, sd: draft always, or let the target decode alone while that measures faster
    min_speculative_tokens: int = 0  # auto: the fewest tokens a step drafts (halving from k; 0: k, or none)
    step_calls: str = "stream"  # Verify and Propose as messages on a stream per worker, or unary calls
    draft_retry_interval: float = 5.0  # seconds between tries to reach a lost draft service again
    draft_timeout: float = 30.0  # a draft call that takes longer counts the draft service as lost
    target_timeout: float = 120.0  # a target step call that takes longer counts the target service as lost (0: never)
    drain_timeout: float = 30.0  # seconds a SIGTERM leaves the admitted requests to finish (`drain`)


def choose_channel(requested: str, target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo) -> str:
    """cuda-ipc when both sides are CUDA on one host, else nccl between GPUs, else grpc; a flag overrides."""
    if requested != "auto":
        for side, info in (("target", target), ("draft", draft)):
            if requested not in info.channels:
                raise ModelLoadError(f"channel {requested!r} is not available on the {side} ({info.device})")
        return requested
    both_cuda = target.device.startswith("cuda") and draft.device.startswith("cuda")
    if both_cuda and target.host_id == draft.host_id:
        return "cuda-ipc"
    return "nccl" if both_cuda else "grpc"


def shared_gpus(target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo) -> list[str]:
    """The GPUs that target and draft both run on, by UUID (a GPU's index differs between containers); a worker of
    before `gpu_uuids` names its first GPU only."""

    def gpus(info: common_pb2.WorkerInfo) -> list[str]:
        return list(info.gpu_uuids) or ([info.gpu_uuid] if info.gpu_uuid else [])

    return [gpu for gpu in gpus(target) if gpu in gpus(draft)]


def _detail(exc: BaseException) -> str:
    """A failed call's message: a gRPC error's details, or the exception's text."""
    return str(exc.details()) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


def _vocab(info: common_pb2.WorkerInfo) -> VocabInfo:
    return VocabInfo(info.logits_size, info.tokenizer_size, info.tokenizer_hash, tuple(info.eos_token_ids))


async def prepare_worker(rpc: Callable[[Any], Awaitable[object]], requests: Sequence[object]) -> float:
    """A worker's Prepare calls, one after the other (one per draft length); returns the seconds they took. A worker
    older than that RPC answers UNIMPLEMENTED and prepares in its SetupChannel, as it always did: a rolling upgrade
    can start a new coordinator before its workers."""
    start = time.perf_counter()
    try:
        for request in requests:
            await rpc(request)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        log.info("a worker without Prepare: it prepares in SetupChannel")
    return time.perf_counter() - start


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self, options: CoordinatorOptions, tracing: Tracing | None = None, metrics: CoordinatorMetrics | None = None
    ) -> None:
        self.options = options
        # Tracing is decided here, once: when it is off, the plain classes run and no span object is ever made.
        self.tracer = tracing.tracer if tracing is not None else None
        self.metrics = metrics
        workers_class = Workers if self.tracer is None else partial(TracedWorkers, tracer=self.tracer)
        self.workers = workers_class(
            options.target, options.draft if options.mode != "ar" else None, step_streams=options.step_calls == "stream"
        )
        num_batches = 2 if options.mode == "psd" else 1
        self.manager = BatchManager(
            options.max_batch_size, options.max_queue_size, num_batches, options.max_prefill_tokens
        )
        loop_class = StepLoop if self.tracer is None else partial(TracedStepLoop, tracer=self.tracer)
        self.loop = loop_class(
            self.workers,
            self.manager,
            options.mode,
            options.num_speculative_tokens,
            metrics=metrics,
            overlap=options.overlap,
            speculation=options.speculation,
            min_k=options.min_speculative_tokens,
        )
        self.loop.draft_back = self.draft_back
        self.loop.hand_over_draft = self.hand_over_draft
        self.loop.target_back = self.target_back
        self.loop.on_target_lost = self._target_lost
        self.loop.draft_retry_interval = options.draft_retry_interval
        self.workers.record_events = options.step_trace is not None
        self.workers.draft_timeout = options.draft_timeout
        self.workers.target_timeout = options.target_timeout or None
        self.workers.metrics = metrics
        if metrics is not None:
            metrics.track_state(
                lambda: self.manager.queue_length,
                lambda: self.manager.num_running,
                lambda: float(self.workers.draft is not None),
                lambda: len(self.manager.batches),
                lambda: float(self.loop.drafting),
                lambda: float(self.loop.draft_length),
            )
        self.tokenizer: object | None = None
        self.target_info = common_pb2.WorkerInfo()
        self.draft_info = common_pb2.WorkerInfo()
        self.channel = "none"
        # A random base: a restarted coordinator never collides with ids a worker may still hold.
        self._seq_ids = itertools.count(secrets.randbits(48))
        self._task: asyncio.Task[None] | None = None
        self.health = Health()  # NOT_SERVING from the start of a drain
        self.draining = False
        # The target reports NOT_SERVING: it is shutting down (`_target_stopping`), so nothing new is admitted.
        self.target_draining = False
        # The draft reports NOT_SERVING (`_draft_stopping`): not drafting, and not taken back until a new one serves.
        self.draft_draining = False
        self._watches: list[asyncio.Task[None]] = []  # `_follow_health` of each worker
        self.open_streams = 0  # Generate calls admitted and not ended
        self._laid_out = False  # the batches' layout is decided at the first connection to the draft

    async def start(self) -> None:
        """Check the pair, set up the channel through both workers' control RPCs, start the step loop."""
        self.target_info = (await self.workers.target.GetInfo(target_pb2.TargetServiceGetInfoRequest())).info
        if self.workers.draft is not None:
            await self._connect_draft()
        else:
            log.info("target prepared in %.1f s", await self._prepare_target())
        tokenizer_dir = self.options.tokenizer or self.target_info.model
        try:
            self.tokenizer = load_tokenizer(tokenizer_dir)
        except ModelLoadError:
            log.warning("no tokenizer at %s: only token-id prompts are served", tokenizer_dir)
        self._task = asyncio.create_task(self.loop.run())
        self._watches = [
            asyncio.create_task(
                self._follow_health(self.workers.target_channel, "target", self._target_stopping, self.loop.lose_target)
            )
        ]
        if self.workers.draft_channel is not None:
            self._watches.append(
                asyncio.create_task(self._follow_health(self.workers.draft_channel, "draft", self._draft_stopping))
            )

    async def _connect_draft(self, timeout: float | None = None) -> None:
        """Check the pair and set the channel up through both workers' control RPCs."""
        draft = self.workers.draft_stub
        assert draft is not None
        self.draft_info = (await draft.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=timeout)).info
        check_pair(_vocab(self.target_info), _vocab(self.draft_info))
        self.channel = choose_channel(self.options.channel, self.target_info, self.draft_info)
        if not self._laid_out:
            self._lay_out_batches()
        k, batch, batches = self.options.num_speculative_tokens, self.manager.max_batch_size, len(self.manager.batches)
        # Both workers' start-up work at once, not one after the other inside the SetupChannels below (which then find
        # it done): run 17d's compiled 8B/1B pair spent 53 s in the draft's and then 75 s in the target's. For a
        # restarted draft, the target's is a no-op.
        draft_s, target_s = await asyncio.gather(
            prepare_worker(
                draft.Prepare,
                [
                    draft_pb2.DraftServicePrepareRequest(
                        num_speculative_tokens=length, max_batch_size=batch, num_batches=batches
                    )
                    for length in self.loop.draft_lengths
                ],
            ),
            self._prepare_target(),
        )
        start = time.perf_counter()
        exported = draft.SetupChannel(
            draft_pb2.DraftServiceSetupChannelRequest(
                channel=self.channel, num_speculative_tokens=k, max_batch_size=batch, num_batches=batches
            )
        )
        # Some transports (nccl) rendezvous: the draft's export and the target's attach must overlap.
        handshake = (await exported).handshake
        await self.workers.target.SetupChannel(
            target_pb2.TargetServiceSetupChannelRequest(
                channel=self.channel,
                handshake=handshake,
                num_speculative_tokens=k,
                max_batch_size=batch,
                num_batches=batches,
            )
        )
        log.info(
            "workers prepared in %.1f s (draft %.1f s, target %.1f s, at once); %s channel set up in %.1f s",
            max(draft_s, target_s),
            draft_s,
            target_s,
            self.channel,
            time.perf_counter() - start,
        )

    def _lay_out_batches(self) -> None:
        """psd with `--overlap auto` on a GPU that target and draft share: one batch of both batches' room, drafted and
        verified one after the other (sd). There a verify of 2B rows costs little more than one of B, and the two
        processes' kernels hardly overlap: on one H200 (8B and 1B shapes, compiled, B=32) one batch of 64 served
        1.14x the tokens of two alternating batches of 32 time-sliced, 1.04x under MPS, at a lower TPOT (runs
        25c/d). `--overlap always` keeps the two batches."""
        self._laid_out = True
        if self.options.mode != "psd" or self.options.overlap != "auto":
            return
        shared = shared_gpus(self.target_info, self.draft_info)
        if shared:
            self.manager.merge_batches()
            self.loop.mode = "sd"
            log.info(
                "target and draft share GPU %s: one batch of up to %d sequences, drafted and verified in turn "
                "(overlapping two batches does not pay on one GPU; --overlap always keeps them)",
                ", ".join(shared),
                self.manager.max_batch_size,
            )

    async def _prepare_target(self) -> float:
        """The target's Prepare (its cache laid out for the batches, their step shapes run before serving); the
        seconds it took. With the draft's in `_connect_draft`, alone when no draft is connected (ar; a target back
        while the draft is lost): without it an ar target captured each CUDA graph at its shape's first use, while
        requests waited."""
        return await prepare_worker(
            self.workers.target.Prepare,
            [
                target_pb2.TargetServicePrepareRequest(
                    num_speculative_tokens=length,
                    max_batch_size=self.manager.max_batch_size,
                    num_batches=len(self.manager.batches),
                )
                for length in self.loop.draft_lengths or (0,)
            ],
        )  # each length's verifies (and the target's steps alone)

    async def draft_back(self) -> bool:
        """While the draft service is lost (a background task of the step loop's): whether it answers a GetInfo
        within 2 s and then takes the channel set-up, which can be long (a restarted draft on a GPU captures its
        CUDA graphs then: 20-30 s for a 1B draft). Steps go on meanwhile with the target alone."""
        if self._refusing_stopping_draft:
            return False
        try:
            await self._connect_draft(timeout=2.0)
        except (grpc.RpcError, ModelLoadError, ValueError) as exc:
            log.info("draft service not back yet: %s", _detail(exc))
            return False
        return True

    async def hand_over_draft(self) -> None:
        """Once `draft_back` (and between steps, so no batch waits on drafts): hand the draft every running request
        (prompt and output so far) and draft again."""
        draft = self.workers.draft_stub
        assert draft is not None
        if self._refusing_stopping_draft:  # it began stopping after `draft_back`: a later probe takes the next one
            return
        running = self.manager.running()
        try:
            # A draft that was only unreachable still holds what was admitted before it was lost.
            stale = sorted(set(self.workers.draft_backlog) | {r.seq_id for r in running})
            await draft.Release(draft_pb2.DraftServiceReleaseRequest(seq_ids=stale), timeout=self.workers.draft_timeout)
            if running:
                await self.workers.prefill_draft(running, resume=True)
        except grpc.RpcError as exc:
            log.info("draft service not back yet: %s", _detail(exc))
            return
        self.workers.draft_backlog = []
        self.workers.draft = draft
        log.warning("draft service back: speculative decoding again (%d running requests handed over)", len(running))

    async def target_back(self) -> bool:
        """While the target service is lost (the step loop's, every --draft-retry-interval): whether it answers a
        GetInfo within 2 s, serves a model the draft still pairs with, and takes the channel set-up again."""
        try:
            info = (await self.workers.target.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=2.0)).info
            if _vocab(info) != _vocab(self.target_info):
                raise ModelLoadError(f"the target came back serving {info.model}, not {self.target_info.model}")
            self.target_info = info
            if self.workers.draft is not None:
                await self._connect_draft(timeout=2.0)
            else:
                log.info("target prepared in %.1f s", await self._prepare_target())
        except (grpc.RpcError, ModelLoadError, ValueError) as exc:
            log.info("target service not back yet: %s", _detail(exc))
            return False
        return True

    async def _target_lost(self, lost: bool) -> None:
        """Health follows the target: NOT_SERVING while it is lost, so that a load balancer sends requests elsewhere."""
        if not lost:
            self.target_draining = False  # a new target, serving
        status = health_pb2.HealthCheckResponse.NOT_SERVING if lost else health_pb2.HealthCheckResponse.SERVING
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, status)

    async def _target_stopping(self, stopping: bool) -> None:
        """The target's health said `stopping` (NOT_SERVING: a SIGTERM alone, as when its pod is replaced; it serves
        its calls on until none has come for a while, or its drain timeout): admit nothing new, so that what was
        admitted finishes on it and it can stop; once its stream ends, it is gone, and the step loop's reconnect takes
        the new one back. Without this the coordinator kept it busy with new requests until its drain timeout cut
        every one of them off."""
        if stopping and not self.target_draining and not self.loop.target_lost:
            log.warning(
                "the target service is shutting down: admitting nothing new until it is back; "
                "%d requests to finish on it",
                self.open_streams,
            )
            await self._target_lost(True)
        self.target_draining = stopping

    async def _draft_stopping(self, stopping: bool) -> None:
        """The draft's health said `stopping`: stop drafting at once (the target decodes alone), so that the draft
        goes quiet and stops long before its drain timeout, and take no draft back through this address while it
        says so (the old process still answers there). Without this a draft replaced alone was kept busy until its
        drain timeout, then lost in the middle of a call. While the coordinator drains too (a whole release
        deleted), the stopping draft drafts on for what is left: it serves as long as calls come."""
        was_draining, self.draft_draining = self.draft_draining, stopping
        if self._refusing_stopping_draft and not was_draining:
            self.loop.leave_draft("the draft service is shutting down")

    @property
    def _refusing_stopping_draft(self) -> bool:
        """Whether the draft says it is stopping and is neither used nor taken back through its address (the old
        process still answers there); while the coordinator drains too, it drafts on."""
        return self.draft_draining and not self.draining

    async def _follow_health(
        self,
        channel: grpc.aio.Channel,
        service: str,
        changed: Callable[[bool], Awaitable[None]],
        gone: Callable[[str], None] | None = None,
    ) -> None:
        """Watch a worker's health for the coordinator's lifetime: `changed(stopping)` with each status it reports,
        `gone(why)` when its stream ends after it said it was stopping (it has stopped) or breaks while it said it
        was serving (killed, crashed, or its host gone); watch again (the next process on its address) every
        --draft-retry-interval. Without the second, an idle coordinator reported SERVING for a killed target until
        a request's call failed."""
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            said: bool | None = None  # whether this stream last said stopping (None: nothing, a failed connect)
            why = "it shut down"
            try:
                async for reply in health.Watch(health_pb2.HealthCheckRequest()):
                    said = reply.status != health_pb2.HealthCheckResponse.SERVING
                    await changed(said)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("the %s service has no health service: its shutdowns are not followed", service)
                    return
                if said is False and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    said, why = True, f"its connection broke ({exc.details()})"
            if said and gone is not None:
                gone(why)
            await asyncio.sleep(self.options.draft_retry_interval)

    async def drain(self, cut_short: asyncio.Event) -> None:
        """Stop taking requests and let the admitted ones finish, for up to `drain_timeout` seconds or until
        `cut_short` is set (a SIGTERM's graceful shutdown, before `stop`): health reports NOT_SERVING, so a load
        balancer or Kubernetes sends new requests elsewhere, and a new Generate call gets UNAVAILABLE."""
        self.draining = True
        await self.health.drain()
        if self.draft_draining:  # left as it began stopping: it may still answer, and drafts finish the drain sooner
            self.loop.probe_draft_now()
        timeout = self.options.drain_timeout
        log.info("draining: %d requests to finish, for up to %.0f s", self.open_streams, timeout)
        deadline = time.monotonic() + timeout
        while self.open_streams and time.monotonic() < deadline and not cut_short.is_set():
            await asyncio.sleep(0.05)
        if self.open_streams:
            log.warning("drain ended with %d requests unfinished: their clients get UNAVAILABLE", self.open_streams)

    async def stop(self) -> None:
        for watch in self._watches:
            watch.cancel()
        self.loop.stop()
        if self._task is not None:
            await self._task
        await self.loop.shutdown()
        if self.options.step_trace:
            with open(self.options.step_trace, "w") as f:
                f.write(self.loop.step_trace())
        await self.workers.close()

    @property
    def max_model_len(self) -> int:
        lengths = [self.target_info.max_model_len]
        if self.workers.draft_stub is not None:
            lengths.append(self.draft_info.max_model_len)
        return min(lengths)

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerInfoResponse:
        return generation_pb2.GetServerInfoResponse(
            target_model=self.target_info.model,
            draft_model=self.draft_info.model,
            mode=self.loop.mode,
            channel=self.channel,
            num_speculative_tokens=self.loop.k,
            max_batch_size=self.manager.max_batch_size,
            max_queue_size=self.options.max_queue_size,
            max_model_len=self.max_model_len,
            vocab_size=self.target_info.logits_size,
        )

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        if self.draining:
            self._rejected("draining")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "this coordinator is shutting down: send the request to another replica or retry",
            )
        if self.loop.target_lost:
            self._rejected("target_lost")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the target service is unreachable; the coordinator "
                f"tries it again every {self.options.draft_retry_interval:g} s: retry shortly",
            )
        if self.target_draining:
            self._rejected("target_draining")
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "the target service is shutting down; the coordinator "
                "finishes the requests it admitted and serves again once a new one is up: retry "
                "shortly",
            )
        try:
            state = self._new_request(request)
            self.manager.submit(state)
        except ValueError as exc:
            self._rejected("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFullError as exc:
            self._rejected("queue_full")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        if self.tracer is not None:
            state.span = start_request_span(
                self.tracer,
                context,
                {
                    "minedraft.seq_id": state.seq_id,
                    "minedraft.prompt_tokens": len(state.prompt_ids),
                    "minedraft.max_tokens": state.config.max_tokens,
                    "minedraft.temperature": state.config.temperature,
                },
            )
        self.loop.wake()
        usage, error = None, None
        self.open_streams += 1
        try:
            while True:
                item = await state.stream.get()
                if isinstance(item, BaseException):
                    code = (
                        item.code()
                        if isinstance(item, grpc.aio.AioRpcError)
                        else grpc.StatusCode.UNAVAILABLE
                        if isinstance(item, Unavailable)
                        else grpc.StatusCode.INTERNAL
                    )
                    error = _detail(item) or "generation failed"
                    await context.abort(code, error)
                    return
                if item.HasField("usage"):
                    usage = item.usage
                yield state.render(item)
                if item.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                    return
        finally:
            if not state.finished:  # the client went away or its deadline passed: free it at the next step
                state.cancelled = True
                self.loop.wake()
            self.open_streams -= 1
            self._ended(state, usage, error)

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.request_rejected(reason)

    def _ended(self, state: RequestState, usage: generation_pb2.Usage | None, error: str | None) -> None:
        """Close the request's span and count it; `usage` is the one its client received, if any."""
        reason = finish_reason_name(state.finish_reason if state.finished else generation_pb2.FINISH_REASON_CANCELLED)
        if self.metrics is not None:
            self.metrics.request_finished(reason, usage, time.perf_counter() - state.created)
        if state.span is not None:
            end_request_span(state.span, reason, usage, error)

    def _new_request(self, request: generation_pb2.GenerateRequest) -> RequestState:
        """The request checked (`coordinator.validation`) and defaulted; a ValueError's message reaches its client."""
        vocab_size = self.target_info.logits_size
        prompt_ids = prompt_token_ids(request, self.tokenizer, vocab_size)
        # The last verify writes k tokens past the final committed one, so that room is reserved too.
        context = self.max_model_len - self.loop.k
        config = sampling_config(request.params, len(prompt_ids), vocab_size, context)
        return RequestState(
            next(self._seq_ids),
            prompt_ids,
            config,
            tuple(s for s in request.params.stop if s),
            self.tokenizer,
            seeded=not config.greedy and request.params.HasField("seed"),
        )


async def serve(
    options: CoordinatorOptions,
    port: int,
    host: str = "[::]",
    tracing: Tracing | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> tuple[grpc.aio.Server, int, GenerationServicer]:
    servicer = GenerationServicer(options, tracing, metrics)
    await servicer.start()
    server, bound = await start_server(
        port,
        [lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)],
        [GENERATION_SERVICE],
        host,
        health_servicer=servicer.health,
    )
    return server, bound, servicer
