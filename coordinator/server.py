"""The public GenerationService: its gRPC API and `serve`, wiring the workers, the batch manager and the step loop."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import grpc

from coordinator.batch_manager import BatchManager, QueueFullError
from coordinator.options import CoordinatorOptions
from coordinator.pairing import Layout, call_detail, prepare_worker, shared_gpus
from coordinator.request_state import RequestState
from coordinator.samples import make_samples, sample_count, total_usage
from coordinator.step_loop import StepLoop, Unavailable
from coordinator.stream_outbox import StreamOutbox
from coordinator.tracing import TracedStepLoop, TracedWorkers
from coordinator.validation import DEFAULT_MAX_TOKENS, check_limits, prompt_token_ids, sampling_config
from coordinator.workers import GENERATION_SERVICE, Refusal, Workers
from minedraft.engine.models import load_tokenizer
from minedraft.errors import ModelLoadError
from minedraft.observability.metrics import CoordinatorMetrics, finish_reason_name
from minedraft.observability.telemetry import Tracing, end_request_span, start_request_span
from minedraft.proto import generation_pb2, generation_pb2_grpc
from minedraft.rpc.lease import deployment_secret
from minedraft.rpc.limits import ConnectionLimits, fitted
from minedraft.rpc.security import coordinator_worker_tls, read_api_key, server_credentials
from minedraft.rpc.server_utils import Health, start_server

if TYPE_CHECKING:
    from coordinator.http_api import HttpServer

# What tools and tests reach through this module besides the servicer
__all__ = [
    "CoordinatorOptions",
    "Generation",
    "GenerationServicer",
    "RequestRefused",
    "prepare_worker",
    "serve",
    "shared_gpus",
]

log = logging.getLogger(__name__)


class RequestRefused(Exception):
    """A request refused at admission, or ended by a failure: the gRPC status its client gets (the HTTP API maps
    it), the message, and the request field at fault where one is."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


@dataclass
class Generation:
    """One admitted request as a front end streams it (the gRPC `Generate`, the HTTP API): `responses` yields its
    messages, `close` ends it however the front end stops; what its client received is kept for the metrics."""

    state: RequestState  # sample 0 (the only one unless the request set n)
    usage: generation_pb2.Usage | None = None  # all samples' together (`total_usage`), once each has finished
    samples: list[RequestState] = field(default_factory=list)  # every sample, by index
    usages: dict[int, generation_pb2.Usage] = field(default_factory=dict)  # each sample's, by index
    error: str | None = None
    closed: bool = False


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    def __init__(
        self, options: CoordinatorOptions, tracing: Tracing | None = None, metrics: CoordinatorMetrics | None = None
    ) -> None:
        self.options = options
        # Tracing is decided here, once: when it is off, the plain classes run and no span object is ever made.
        self.tracer = tracing.tracer if tracing is not None else None
        self.metrics = metrics
        self.health = Health()  # follows the target's (`Workers`); NOT_SERVING from the start of a drain
        self.open_streams = 0  # Generate calls admitted and not ended
        wake = asyncio.Event()  # the step loop's: new work, a stop, or news from the workers
        outbox = StreamOutbox()  # what a step emits, until the next worker calls are sent
        workers_class = Workers if self.tracer is None else partial(TracedWorkers, tracer=self.tracer)
        self.workers = workers_class(
            options.target,
            options.draft if options.mode != "ar" else None,
            step_streams=options.step_calls == "stream",
            channel=options.channel,
            draft_timeout=options.draft_timeout,
            target_timeout=options.target_timeout or None,
            retry_interval=options.draft_retry_interval,
            metrics=metrics,
            record_events=options.step_trace is not None,
            call_started=outbox.call_started,
            health=self.health,
            wake=wake,
            open_requests=lambda: self.open_streams,
            tls=coordinator_worker_tls(options.tls_ca, options.tls_cert, options.tls_key, options.tls_server_name),
        )
        secret = deployment_secret(options.lease_secret)  # workers started with one want it (else: this process's)
        if secret is not None:
            for ticket in self.workers.pair.tickets.values():
                ticket.secret = secret
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
            outbox=outbox,
            wake=wake,
            metrics=metrics,
            overlap=options.overlap,
            speculation=options.speculation,
            min_k=options.min_speculative_tokens,
        )
        if metrics is not None:
            metrics.track_state(
                lambda: self.manager.queue_length,
                lambda: self.manager.num_running,
                lambda: float(self.workers.draft_connected),
                lambda: len(self.manager.batches),
                lambda: float(self.loop.drafting),
                lambda: float(self.loop.draft_length),
            )
        self.tokenizer: object | None = None
        self.http: HttpServer | None = None  # the HTTP API, when `serve` started it
        # A random base: a restarted coordinator never collides with ids a worker may still hold.
        self._seq_ids = itertools.count(secrets.randbits(48))
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    async def start(self) -> None:
        """Check the pair, lay the batches out, set up the channel through both workers' control RPCs, start the
        step loop, and follow the workers' health."""
        pair = self.workers.pair
        await pair.connect()
        self.workers.keep_leases()
        if self.workers.has_draft:
            self._lay_out_batches()
        await pair.set_up(
            Layout(
                self.manager.max_batch_size,
                len(self.manager.batches),
                self.options.num_speculative_tokens,
                self.loop.draft_lengths,
            )
        )
        self.workers.reset_kv_blocks()
        tokenizer_dir = self.options.tokenizer or pair.target_info.model
        try:
            # In a thread: this start's synchronous work after SetUp (this load, with transformers' import, and the
            # HTTP module's) took 14 s on a GPU host, long enough for the workers' leases, which this loop renews.
            self.tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_dir)
        except ModelLoadError:
            log.warning("no tokenizer at %s: only token-id prompts are served", tokenizer_dir)
        self._task = asyncio.create_task(self.loop.run())
        self.workers.watch_health()

    def _lay_out_batches(self) -> None:
        """psd with `--overlap auto` on a GPU that target and draft share: one batch of both batches' room, drafted and
        verified one after the other (sd). There a verify of 2B rows costs little more than one of B, and the two
        processes' kernels hardly overlap: on one H200 (8B and 1B shapes, compiled, B=32) one batch of 64 served
        1.14x the tokens of two alternating batches of 32 time-sliced, 1.04x under MPS, at a lower TPOT.
        `--overlap always` keeps the two batches."""
        if self.options.mode != "psd" or self.options.overlap != "auto":
            return
        shared = shared_gpus(self.workers.pair.target_info, self.workers.pair.draft_info)
        if shared:
            self.manager.merge_batches()
            self.loop.mode = "sd"
            log.info(
                "target and draft share GPU %s: one batch of up to %d sequences, drafted and verified in turn "
                "(overlapping two batches does not pay on one GPU; --overlap always keeps them)",
                ", ".join(shared),
                self.manager.max_batch_size,
            )

    async def drain(self, cut_short: asyncio.Event) -> None:
        """Stop taking requests and let the admitted ones finish, for up to `drain_timeout` seconds or until
        `cut_short` is set (a SIGTERM's graceful shutdown, before `stop`): health reports NOT_SERVING, so a load
        balancer or Kubernetes sends new requests elsewhere, and a new Generate call gets UNAVAILABLE."""
        await self.workers.drain()
        timeout = self.options.drain_timeout
        log.info("draining: %d requests to finish, for up to %.0f s", self.open_streams, timeout)
        deadline = time.monotonic() + timeout
        while self.open_streams and time.monotonic() < deadline and not cut_short.is_set():
            await asyncio.sleep(0.05)
        if self.open_streams:
            log.warning("drain ended with %d requests unfinished: their clients get UNAVAILABLE", self.open_streams)

    async def stop(self) -> None:
        self._stopping = True
        if self.http is not None:
            self.http.begin_stop()  # no new connections; open streams end with the step loop's shutdown below
        self.workers.stop_failover()
        self.loop.stop()
        if self._task is not None:
            await self._task
        await self.loop.shutdown()
        if self.http is not None:
            await self.http.stopped()
        if self.options.step_trace:
            with open(self.options.step_trace, "w") as f:
                f.write(self.loop.step_trace())
        await self.workers.close()

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerInfoResponse:
        pair = self.workers.pair
        return generation_pb2.GetServerInfoResponse(
            target_model=pair.target_info.model,
            draft_model=pair.draft_info.model,
            mode=self.loop.mode,
            channel=pair.channel,
            num_speculative_tokens=self.loop.k,
            max_batch_size=self.manager.max_batch_size,
            max_queue_size=self.options.max_queue_size,
            max_model_len=self.context_length,  # what a request may hold, as its errors say
            vocab_size=pair.target_info.logits_size,
        )

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        try:
            generation = await self.admit(request, context.invocation_metadata())
        except RequestRefused as exc:
            await context.abort(exc.code, exc.message)
        try:
            async for message in self.responses(generation):
                yield message
        except RequestRefused as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self.close(generation)

    async def admit(
        self,
        request: generation_pb2.GenerateRequest,
        trace_metadata: Iterable[tuple[str, Any]] | None = None,
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        http_route: str | None = None,
    ) -> Generation:
        """Check `request` and queue it for the step loop, for either front end; RequestRefused says why not
        (UNAVAILABLE, INVALID_ARGUMENT, RESOURCE_EXHAUSTED). The caller streams it with `responses` and must
        `close` it. `trace_metadata`: where a client's traceparent is (gRPC metadata, HTTP headers);
        `default_max_tokens`: max_tokens when the request sets none (None: the rest of the context);
        `http_route`: the HTTP API's route it came by (its span's name), None for gRPC."""
        self._refuse_if_unavailable()
        try:
            check_limits(request, self.options.limits)
            state = await self._new_request(request, default_max_tokens)
            self._refuse_if_unavailable()  # the workers may have gone, or a stop begun, while it tokenized
            samples = make_samples(state, sample_count(request, self.options.max_queue_size), self._seq_ids)
            self.manager.submit_all(samples)
        except ValueError as exc:
            self._rejected("invalid")
            raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), getattr(exc, "param", None)) from exc
        except QueueFullError as exc:
            self._rejected("queue_full")
            raise RequestRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        if self.tracer is not None:
            state.span = start_request_span(
                self.tracer,
                trace_metadata,
                {
                    "minedraft.seq_id": state.seq_id,
                    "minedraft.prompt_tokens": len(state.prompt_ids),
                    "minedraft.max_tokens": state.config.max_tokens,
                    "minedraft.temperature": state.config.temperature,
                    "minedraft.n": len(samples),
                },
                http_route,
            )
            for sample in samples[1:]:  # the call's one span: every sample's worker calls link to it
                sample.span = state.span
        self.loop.wake()
        self.open_streams += 1
        return Generation(state, samples=samples)

    def _refuse_if_unavailable(self) -> None:
        """RequestRefused (UNAVAILABLE) while the workers cannot take requests or this coordinator is stopping."""
        refusal = self.workers.refusal()
        if refusal is None and self._stopping:
            refusal = Refusal("stopping", "this coordinator is stopping: send the request to another replica or retry")
        if refusal is not None:
            self._rejected(refusal.reason)
            raise RequestRefused(grpc.StatusCode.UNAVAILABLE, refusal.message)

    async def responses(self, generation: Generation) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The admitted request's messages as the step loop emits them, text filled in, up to the one with its
        finish reason; RequestRefused (the status its client gets) if it failed meanwhile."""
        state, samples = generation.state, generation.samples or [generation.state]
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
                generation.error = call_detail(item) or "generation failed"
                raise RequestRefused(code, generation.error)
            if item.HasField("usage"):
                generation.usages[item.index] = item.usage
                if len(generation.usages) == len(samples):
                    generation.usage = total_usage([generation.usages[i] for i in range(len(samples))])
            yield samples[item.index].render(item)
            if generation.usage is not None:  # every sample has finished
                return

    def close(self, generation: Generation) -> None:
        """End a request however its front end stopped (finished, failed, or its client gone: then it is cancelled
        and freed at the next step); closing it again does nothing."""
        if generation.closed:
            return
        generation.closed = True
        samples = generation.samples or [generation.state]
        for state in samples:
            if not state.finished:  # the client went away or its deadline passed: free it at the next step
                state.cancelled = True
                self.loop.wake()
        self.open_streams -= 1
        for state in samples:
            self._ended(state, generation.usages.get(state.index), generation.error)

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.request_rejected(reason)

    def _ended(self, state: RequestState, usage: generation_pb2.Usage | None, error: str | None) -> None:
        """Close the request's span and count it; `usage` is the one its client received, if any."""
        reason = finish_reason_name(state.finish_reason if state.finished else generation_pb2.FINISH_REASON_CANCELLED)
        if self.metrics is not None:
            self.metrics.request_finished(reason, usage, time.perf_counter() - state.created)
        if state.span is not None and state.index == 0:  # the span of the call, shared by its samples
            end_request_span(state.span, reason, usage, error)

    @property
    def context_length(self) -> int:
        """The tokens a request may hold, prompt and output: the last verify writes k tokens past the final
        committed one, so that room is reserved too."""
        return self.workers.pair.max_model_len - self.loop.k

    async def _new_request(
        self, request: generation_pb2.GenerateRequest, default_max_tokens: int | None
    ) -> RequestState:
        """The request checked (`coordinator.validation`) and defaulted; a ValueError's message reaches its client."""
        vocab_size = self.workers.pair.target_info.logits_size
        if request.prompt or request.messages:
            # In a thread: a long prompt's tokenizing (or chat template) must not stall the other streams.
            prompt_ids = await asyncio.to_thread(prompt_token_ids, request, self.tokenizer, vocab_size)
        else:
            prompt_ids = prompt_token_ids(request, self.tokenizer, vocab_size)
        config = sampling_config(request.params, len(prompt_ids), vocab_size, self.context_length, default_max_tokens)
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
    """The coordinator: the servicer started, its gRPC server on `port` and, with `options.http_port`, the
    OpenAI-compatible HTTP API beside it in this event loop (`servicer.http`; `servicer.stop` stops it); both serve
    TLS only with `options.tls_cert`, and want the bearer token with an API key."""
    # Checked before the workers are dialled: a wrong file fails the start-up at once, with its flag named.
    credentials = server_credentials(options.tls_cert, options.tls_key)
    api_key = read_api_key(options.api_key, options.api_key_file)
    limits = ConnectionLimits(options.max_connections, options.header_timeout, options.idle_timeout)
    limits.check()
    limits = fitted(limits, 2 if options.http_port else 1)  # each port its own descriptors: neither starves the other
    servicer = GenerationServicer(options, tracing, metrics)
    await servicer.start()
    server, bound = await start_server(
        port,
        [lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)],
        [GENERATION_SERVICE],
        host,
        health_servicer=servicer.health,
        max_receive_bytes=options.max_request_bytes,
        credentials=credentials,
        api_key=api_key,
        limits=limits,
    )
    if options.http_port:
        # Imported in a thread (it imports FastAPI), so that the leases' heartbeat goes on; here, as it imports this
        # module.
        await asyncio.to_thread(importlib.import_module, "coordinator.http_api")
        from coordinator.http_api import start_http_server

        servicer.http = start_http_server(servicer, options.http_port, host, api_key, limits)
    return server, bound, servicer
