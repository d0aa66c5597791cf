"""Tracing of the step loop: a span per step, whose batched worker calls link to the spans of their requests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from coordinator.request_state import RequestState
from minedraft.observability.telemetry import (
    TraceContextInjector,
    batch_span,
    inject_metadata,
    links_to,
    message_attributes,
)

PEERS = {"target": "minedraft-target", "draft": "minedraft-draft"}


class StepTracing:
    """Tracing off: what `Workers` and `StepLoop` call around their work, doing nothing (no span object is ever
    made). `tracing_for` gives `SpanTracing` where tracing is on."""

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        """What the workers' channels carry calls through (the trace context in their metadata)."""
        return []

    @contextlib.contextmanager
    def step(self, attributes: dict[str, Any]) -> Iterator[None]:
        """Around one step of the loop."""
        yield

    @contextlib.contextmanager
    def call(self, kind: str, worker: str, requests: Sequence[RequestState], **attributes: Any) -> Iterator[Any | None]:
        """Around one worker call (`kind`: prefill, propose or verify) serving `requests`; yields its span."""
        yield None

    def replied(self, span: Any, reply: Any) -> None:
        """The call of `span` answered `reply`."""

    def trace_context(self) -> dict[str, str]:
        """The current trace context, for a message on a step stream."""
        return {}

    def released(self, seq_ids: Sequence[int]) -> None:
        """Sequences queued for release (`Workers.release_later`)."""


class SpanTracing(StepTracing):
    """Tracing on: a step is the root span of its trace, its worker calls CLIENT spans that link to every request
    they serve; the trace context travels in the calls' metadata."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        # Release gets bare sequence ids: it links through the request spans remembered at their first call.
        self._request_spans: dict[int, Any] = {}

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [TraceContextInjector()]

    @contextlib.contextmanager
    def step(self, attributes: dict[str, Any]) -> Iterator[None]:
        with self.tracer.start_as_current_span("step", attributes=attributes):
            yield

    @contextlib.contextmanager
    def call(self, kind: str, worker: str, requests: Sequence[RequestState], **attributes: Any) -> Iterator[Any | None]:
        if kind == "prefill" and worker == "target":
            self._request_spans.update((r.seq_id, r.span) for r in requests if r.span is not None)
        names = {f"minedraft.{name}": value for name, value in attributes.items()}
        with batch_span(
            self.tracer,
            kind,
            links_to(r.span for r in requests),
            {
                "peer.service": PEERS[worker],
                "minedraft.batch_size": len(requests),
                "minedraft.seq_ids": [r.seq_id for r in requests],
                **names,
            },
        ) as span:
            yield span

    def replied(self, span: Any, reply: Any) -> None:
        span.set_attributes(message_attributes(reply))

    def trace_context(self) -> dict[str, str]:
        return dict(inject_metadata())

    def released(self, seq_ids: Sequence[int]) -> None:
        if not seq_ids:
            return
        spans = [self._request_spans.pop(s, None) for s in seq_ids]
        attributes = {"minedraft.batch_size": len(seq_ids), "minedraft.seq_ids": list(seq_ids)}
        with batch_span(self.tracer, "release", links_to(spans), attributes):  # queued: it rides on the next calls
            pass


def tracing_for(tracer: Any) -> StepTracing:
    """Tracing is decided once: `SpanTracing` with a tracer, else the plain kind."""
    return StepTracing() if tracer is None else SpanTracing(tracer)
