"""The front door both public APIs go through: admission and refusal, streaming, cancellation."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from coordinator.batch_manager import BatchManager, QueueFullError
from coordinator.failover import Refusal
from coordinator.options import CoordinatorOptions
from coordinator.pairing import call_detail
from coordinator.request_state import RequestState
from coordinator.samples import make_samples, sample_count, total_usage
from coordinator.step_loop import StepLoop, Unavailable
from coordinator.validation import DEFAULT_MAX_TOKENS, check_limits, prompt_token_ids, sampling_config
from coordinator.workers import Workers
from minedraft.engine import grammar
from minedraft.errors import InvalidRequest
from minedraft.observability.metrics import CoordinatorMetrics, finish_reason_name
from minedraft.observability.telemetry import end_request_span, start_request_span
from minedraft.proto import generation_pb2
from minedraft.rpc.server_utils import Health

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


class FrontDoor:
    """What the gRPC and the HTTP API share (TGI's `Infer`): `admit` checks a request and queues it for the step
    loop, `responses` streams it, `close` ends it however its client stopped. It refuses new requests while the
    workers cannot take them or the coordinator stops (`refuse_new`)."""

    def __init__(
        self,
        options: CoordinatorOptions,
        workers: Workers,
        manager: BatchManager,
        loop: StepLoop,
        health: Health,
        tracer: Any = None,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.options, self.workers, self.manager, self.loop = options, workers, manager, loop
        self.health = health  # the coordinator's: follows the target's, NOT_SERVING from the start of a drain
        self.tracer, self.metrics = tracer, metrics
        self.tokenizer: object | None = None  # loaded at start-up (`Coordinator.start`); None: token ids only
        self.open_streams = 0  # requests admitted and not closed
        self._stopping = False  # written by `refuse_new` only
        # A random base: a restarted coordinator never collides with ids a worker may still hold.
        self._seq_ids = itertools.count(secrets.randbits(48))

    @property
    def model(self) -> str:
        """The served model's name: the first of --served-model-name, else the target's."""
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """The names a request may give the served model (--served-model-name, else the target's)."""
        return list(self.options.served_model_name or ()) or [self.workers.pair.target_info.model]

    def refuse_new(self) -> None:
        """From now on every new request is refused UNAVAILABLE (the coordinator is stopping)."""
        self._stopping = True

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
        except InvalidRequest as exc:  # (any other error is a fault of ours, not the client's: never a 400)
            self._rejected("invalid")
            raise RequestRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.param) from exc
        except QueueFullError as exc:
            self._rejected("queue_full")
            raise RequestRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from exc
        except RequestRefused:
            raise
        except Exception as exc:  # a fault of ours: INTERNAL, logged with its trace, never the client's 400
            log.exception("admission failed")
            self._rejected("internal")
            raise RequestRefused(grpc.StatusCode.INTERNAL, f"internal error admitting the request: {exc!r}") from exc
        if self.tracer is not None:
            state.client.span = start_request_span(
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
                sample.client.span = state.client.span
        self.loop.wake()
        self.open_streams += 1
        return Generation(state, samples=samples)

    def _refuse_if_unavailable(self) -> None:
        """RequestRefused (UNAVAILABLE) while the workers cannot take requests or this coordinator is stopping."""
        refusal = self.workers.failover.refusal()
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
            item = await state.client.queue.get()
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
                state.client.cancelled = True
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
            self.metrics.request_finished(reason, usage, time.perf_counter() - state.request.created)
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
        if config.grammar is not None:  # a schema, regex or grammar that reads (remembered), off the event loop
            await asyncio.to_thread(grammar.check, config.grammar)
        return RequestState(
            next(self._seq_ids),
            prompt_ids,
            config,
            tuple(s for s in request.params.stop if s),
            self.tokenizer,
            seeded=not config.greedy and request.params.HasField("seed"),
        )
