"""Tracing of the step loop: one trace per step, whose batched worker calls link to the spans of their requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coordinator.request_state import RequestState
from coordinator.step_loop import StepLoop
from coordinator.workers import Workers
from minedraft.observability.telemetry import (
    TraceContextInjector,
    batch_span,
    inject_metadata,
    links_to,
    message_attributes,
)
from minedraft.proto import common_pb2, draft_pb2, target_pb2

TARGET, DRAFT = "minedraft-target", "minedraft-draft"


class TracedWorkers(Workers):
    """Workers whose calls are CLIENT spans (children of the current step span) that link to every request they
    serve; the trace context travels in the calls' metadata. Used only when tracing is on."""

    def __init__(self, target_address: str, draft_address: str | None, tracer: Any, **options: Any) -> None:
        """`options`: `Workers`' own."""
        super().__init__(target_address, draft_address, interceptors=[TraceContextInjector()], **options)
        self.tracer = tracer
        # Release gets bare sequence ids: it links through the request spans remembered at prefill.
        self._request_spans: dict[int, Any] = {}

    def _span(self, name: str, peer: str, requests: Sequence[RequestState], **attributes: Any) -> Any:
        return batch_span(
            self.tracer,
            name,
            links_to(r.span for r in requests),
            {
                "peer.service": peer,
                "minedraft.batch_size": len(requests),
                "minedraft.seq_ids": [r.seq_id for r in requests],
                **attributes,
            },
        )

    async def prefill_target(self, requests: Sequence[RequestState]) -> target_pb2.TargetServicePrefillResponse:
        self._request_spans.update((r.seq_id, r.span) for r in requests if r.span is not None)
        with self._span("prefill", TARGET, requests) as span:
            reply = await super().prefill_target(requests)
            span.set_attributes(message_attributes(reply))
            return reply

    async def prefill_draft(self, requests: Sequence[RequestState], resume: bool = False) -> None:
        with self._span("prefill", DRAFT, requests, **{"minedraft.resume": resume}):
            await super().prefill_draft(requests, resume)

    async def propose(
        self, step_id: int, batch_id: int, members: Sequence[RequestState], k: int
    ) -> draft_pb2.ProposeResponse:
        with self._span(
            "propose",
            DRAFT,
            members,
            **{
                "minedraft.step_id": step_id,
                "minedraft.batch_id": batch_id,
                "minedraft.num_draft_tokens": k,
            },
        ) as span:
            reply = await super().propose(step_id, batch_id, members, k)
            span.set_attributes(message_attributes(reply))
            return reply

    async def verify(
        self,
        step_id: int,
        batch_id: int,
        members: Sequence[RequestState],
        drafts: common_pb2.DraftPayload | None,
        k: int,
    ) -> target_pb2.VerifyResponse:
        with self._span(
            "verify",
            TARGET,
            members,
            **{
                "minedraft.step_id": step_id,
                "minedraft.batch_id": batch_id,
                "minedraft.num_draft_tokens": k,
            },
        ) as span:
            reply = await super().verify(step_id, batch_id, members, drafts, k)
            span.set_attributes(message_attributes(reply))
            return reply

    def trace_context(self) -> dict[str, str]:
        return dict(inject_metadata())

    def release_later(self, seq_ids: Sequence[int]) -> None:
        if not seq_ids:
            return
        spans = [self._request_spans.pop(s, None) for s in seq_ids]
        attributes = {"minedraft.batch_size": len(seq_ids), "minedraft.seq_ids": list(seq_ids)}
        with batch_span(self.tracer, "release", links_to(spans), attributes):  # queued: it rides on the next calls
            super().release_later(seq_ids)


class TracedStepLoop(StepLoop):
    """The step loop with a span per step: the root of the step's trace, parent of its worker calls (so a PSD
    step shows verify and propose side by side). Used only when tracing is on."""

    def __init__(self, *args: Any, tracer: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracer = tracer

    async def step(self) -> None:
        attributes = {
            "minedraft.mode": self.mode,
            "minedraft.queue_length": self.manager.queue_length,
            "minedraft.running": self.manager.num_running,
        }
        with self.tracer.start_as_current_span("step", attributes=attributes):
            await super().step()
