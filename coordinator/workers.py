"""Clients of the two workers as the step loop sees them, recording a timed event per call."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import grpc

from coordinator.request_state import RequestState
from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, target_pb2, target_pb2_grpc
from minedraft.rpc.server_utils import CHANNEL_OPTIONS
from minedraft.rpc.step_stream import StepStream

if TYPE_CHECKING:
    from minedraft.observability.metrics import CoordinatorMetrics

Call = TypeVar("Call")
Reply = TypeVar("Reply")
log = logging.getLogger(__name__)


@dataclass
class StepEvent:
    """One worker call: which, on which batch, and when (coordinator's clock, seconds)."""

    kind: str  # "prefill", "propose" or "verify"
    batch_id: int
    batch_size: int
    start: float
    end: float
    worker_compute_s: float = 0.0
    channel_s: float = 0.0
    worker_queue_s: float = 0.0  # waiting in the worker for its compute thread
    worker_s: float = 0.0  # the worker's handler from start to reply; the rest of the call is gRPC and event loops
    num_drafts: int = 0  # tokens drafted per sequence (propose), or verified (verify)


def sequence_spec(request: RequestState, resume: bool = False) -> common_pb2.SequenceSpec:
    """The request as a worker prefills it; `resume`: with its output so far but the last token, which the next
    proposal feeds (a draft service that joins a running request)."""
    c = request.config
    params = generation_pb2.SamplingParams(
        max_tokens=c.max_tokens,
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k,
        seed=c.seed,
        stop_token_ids=list(c.stop_token_ids),
        ignore_eos=c.ignore_eos,
    )
    tokens = request.prompt_ids + request.output_ids[:-1] if resume else request.prompt_ids
    return common_pb2.SequenceSpec(seq_id=request.seq_id, prompt_token_ids=tokens, params=params)


class Workers:
    """The target and draft control stubs; the draft is absent in `ar` mode."""

    def __init__(
        self,
        target_address: str,
        draft_address: str | None,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        step_streams: bool = True,
    ) -> None:
        self._channels = [
            grpc.aio.insecure_channel(target_address, options=CHANNEL_OPTIONS, interceptors=list(interceptors))
        ]
        self.target_channel = self._channels[0]
        self.target = target_pb2_grpc.TargetServiceStub(self.target_channel)
        # `draft` is the stub in use; `draft_stub` stays when the draft service is lost, to reconnect through.
        self.draft: draft_pb2_grpc.DraftServiceStub | None = None
        self.draft_stub: draft_pb2_grpc.DraftServiceStub | None = None
        self.draft_channel: grpc.aio.Channel | None = None
        if draft_address:
            self.draft_channel = grpc.aio.insecure_channel(
                draft_address, options=CHANNEL_OPTIONS, interceptors=list(interceptors)
            )
            self._channels.append(self.draft_channel)
            self.draft = self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_channel)
        # Verify and Propose as messages on a stream per worker (`StepStream`), unless unary calls are asked for.
        self.verify_stream = (
            StepStream(self.target.VerifyStream, target_pb2.VerifyStreamRequest) if step_streams else None
        )
        self.propose_stream = (
            StepStream(self.draft_stub.ProposeStream, draft_pb2.ProposeStreamRequest)
            if step_streams and self.draft_stub is not None
            else None
        )
        self.draft_backlog: list[int] = []  # what the draft may still hold after a loss: released when it is back
        # A draft call that outlives this is a lost draft (a hung process must not stall the target's decoding);
        # a target call that outlives its own is a lost target (`StepLoop._lose_target`). None: no deadline.
        self.draft_timeout: float | None = 30.0
        self.target_timeout: float | None = 120.0
        self.events: list[StepEvent] = []
        self.record_events = False
        self.metrics: CoordinatorMetrics | None = None
        # Told as a call is made that the step's GPU work waits on, a target call or one made while one runs (the
        # step loop's outbox: the clients' stream handlers run meanwhile). Not a proposal made alone: it is a step's
        # shortest call, and its reply is what the verify that follows waits for.
        self.call_started: Callable[[], None] | None = None
        self._target_calls = 0  # in flight
        # Sequences to release on each worker, sent with the next call to it (`release_later`).
        self.unreleased: dict[str, list[int]] = {"target": [], "draft": []}

    def _started(self, call: Call) -> Call:
        if self.call_started is not None and self._target_calls:
            self.call_started()
        return call

    @contextlib.contextmanager
    def _on_target(self) -> Iterator[None]:
        """Around a target call, from before it is made (so that `_started` sees it) until its reply."""
        self._target_calls += 1
        try:
            yield
        finally:
            self._target_calls -= 1

    def _step_call(
        self, stream: StepStream | None, unary: Callable[..., Awaitable[Reply]], request: object, timeout: float | None
    ) -> Awaitable[Reply]:
        """A Verify or Propose call, sent now: on the worker's step stream, or unary where there is none (asked
        for, or a worker that has none: it answers the first message UNIMPLEMENTED and gets this call again)."""
        if stream is None or stream.unimplemented:
            return unary(request, timeout=timeout)
        reply = stream.call(request, timeout, self.trace_context())

        async def or_unary() -> Reply:
            try:
                return cast(Reply, await reply)
            except grpc.aio.AioRpcError:
                if not stream.unimplemented:
                    raise
                log.warning("a worker has no step streams (an older version): unary step calls to it from now on")
                return await unary(request, timeout=timeout)

        return or_unary()

    def trace_context(self) -> dict[str, str]:
        """The caller's trace context for a message on a step stream (`TracedWorkers`: the current span's)."""
        return {}

    async def close(self) -> None:
        for stream in (self.verify_stream, self.propose_stream):
            if stream is not None:
                await stream.close()
        for channel in self._channels:
            await channel.close()

    def _record(
        self, kind: str, batch_id: int, size: int, start: float, timings: common_pb2.Timings, k: int = 0
    ) -> None:
        end = time.perf_counter()
        if self.metrics is not None:
            self.metrics.worker_call(kind, size, start, end)
        if self.record_events:
            self.events.append(
                StepEvent(
                    kind,
                    batch_id,
                    size,
                    start,
                    end,
                    timings.compute_s,
                    timings.channel_s,
                    timings.queue_s,
                    timings.end_unix_s - timings.start_unix_s,
                    k,
                )
            )

    async def prefill_target(self, requests: Sequence[RequestState]) -> target_pb2.TargetServicePrefillResponse:
        start = time.perf_counter()
        with self._releasing("target") as released, self._on_target():
            reply = await self._started(
                self.target.Prefill(
                    target_pb2.TargetServicePrefillRequest(
                        sequences=[sequence_spec(r) for r in requests], release_seq_ids=released
                    ),
                    timeout=self.target_timeout,
                )
            )
        self._record("prefill", -1, len(requests), start, reply.timings)
        return reply

    async def prefill_draft(self, requests: Sequence[RequestState], resume: bool = False) -> None:
        assert self.draft_stub is not None
        with self._releasing("draft") as released:
            await self._started(
                self.draft_stub.Prefill(
                    draft_pb2.DraftServicePrefillRequest(
                        sequences=[sequence_spec(r, resume) for r in requests], release_seq_ids=released
                    ),
                    timeout=self.draft_timeout,
                )
            )
        if resume:
            for request in requests:
                request.draft_from = len(request.output_ids) - 1

    async def propose(
        self, step_id: int, batch_id: int, members: Sequence[RequestState], k: int
    ) -> draft_pb2.ProposeResponse:
        assert self.draft is not None
        start = time.perf_counter()
        request = draft_pb2.ProposeRequest(
            step_id=step_id,
            batch_id=batch_id,
            seq_ids=[r.seq_id for r in members],
            num_accepted=[r.num_accepted for r in members],
            next_token_ids=[r.last_token for r in members],
            num_draft_tokens=k,
        )
        missed = [r.missed_by_draft for r in members]
        if any(missed):  # (after steps decoded without drafts)
            request.num_missed_tokens.extend(len(m) for m in missed)
            request.missed_token_ids.extend(t for m in missed for t in m)
        with self._releasing("draft") as released:
            request.release_seq_ids.extend(released)
            reply = await self._started(
                self._step_call(self.propose_stream, self.draft.Propose, request, self.draft_timeout)
            )
        self._record("propose", batch_id, len(members), start, reply.timings, k)
        return reply

    async def verify(
        self,
        step_id: int,
        batch_id: int,
        members: Sequence[RequestState],
        drafts: common_pb2.DraftPayload | None,
        k: int,
    ) -> target_pb2.VerifyResponse:
        start = time.perf_counter()
        request = target_pb2.VerifyRequest(
            step_id=step_id, batch_id=batch_id, seq_ids=[r.seq_id for r in members], num_draft_tokens=k
        )
        if drafts is not None:
            request.drafts.CopyFrom(drafts)
        with self._releasing("target") as released, self._on_target():
            request.release_seq_ids.extend(released)
            reply = await self._started(
                self._step_call(self.verify_stream, self.target.Verify, request, self.target_timeout)
            )
        self._record("verify", batch_id, len(members), start, reply.timings, k)
        return reply

    def release_later(self, seq_ids: Sequence[int]) -> None:
        """Free the rows of `seq_ids` on both workers with the next call to each (a round trip saved per step that
        finishes a request); `flush_releases` sends what no call took."""
        self.unreleased["target"] += seq_ids
        if self.draft is not None:  # a lost draft's rows are freed when it is back (draft_backlog)
            self.unreleased["draft"] += seq_ids

    @contextlib.contextmanager
    def _releasing(self, worker: str) -> Iterator[list[int]]:
        """The releases a call to `worker` carries; put back if the call fails (releasing is idempotent)."""
        released, self.unreleased[worker] = self.unreleased[worker], []
        try:
            yield released
        except BaseException:
            self.unreleased[worker] = released + self.unreleased[worker]
            raise

    async def flush_releases(self, always: bool = False) -> grpc.RpcError | None:
        """Release calls for what no other call took, on both workers at once (`always`: even with nothing to
        release, so that their free-slots gauges are current). A failure on the target raises; one on the draft is
        returned, for the step loop to decide whether the draft is lost."""

        async def on_target() -> None:
            if always or self.unreleased["target"]:
                with self._releasing("target") as released, self._on_target():
                    await self._started(
                        self.target.Release(
                            target_pb2.TargetServiceReleaseRequest(seq_ids=released), timeout=self.target_timeout
                        )
                    )

        async def on_draft() -> grpc.RpcError | None:
            if self.draft is None or not (always or self.unreleased["draft"]):
                return None
            try:
                with self._releasing("draft") as released:
                    await self._started(
                        self.draft.Release(
                            draft_pb2.DraftServiceReleaseRequest(seq_ids=released), timeout=self.draft_timeout
                        )
                    )
            except grpc.RpcError as exc:
                return exc
            return None

        draft_error, _ = await asyncio.gather(on_draft(), on_target())
        return draft_error
