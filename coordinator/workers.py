"""The calls of the steps to the two workers: prefill, propose, verify and release, each through its `WorkerLink`."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from coordinator.failover import Failover
from coordinator.kv_blocks import BlockLedger
from coordinator.pairing import Pair
from coordinator.request_state import RequestState
from coordinator.tracing import StepTracing
from coordinator.worker_link import DRAFT_LATE_FLOOR_S, TARGET_LATE_FLOOR_S, LinkState, WorkerLink
from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from minedraft.rpc.lease import Ticket, presenting
from minedraft.rpc.security import ClientTls, aio_channel
from minedraft.rpc.server_utils import Health, worker_channel_options
from minedraft.rpc.step_stream import StepStream

if TYPE_CHECKING:
    from minedraft.observability.metrics import CoordinatorMetrics

Step = TypeVar("Step", draft_pb2.ProposeResponse, target_pb2.VerifyResponse)


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
    """The request as a worker prefills it: its prompt and the output it had when last preempted (`RequestState.
    preempt`), for what it may still generate; `resume`: with its output so far but the last token, which the next
    proposal feeds (a draft service that joins a running request)."""
    params = request.config.to_proto()
    params.max_tokens = request.config.max_tokens - request.decode.resumed_output  # (its output then is prompt)
    tokens = request.prompt_ids + request.output_ids[:-1] if resume else request.prefill_ids
    output = len(tokens) - len(request.prompt_ids)  # penalties and min_tokens count these as output
    return common_pb2.SequenceSpec(seq_id=request.seq_id, prompt_token_ids=tokens, params=params, output_tokens=output)


class Workers:
    """The target and draft services as the step loop calls them: a `WorkerLink` each (`target`, `draft`; the
    draft's is ABSENT in ar), the pair they make (`pair`), and `failover`, the one writer of what the coordinator
    believes of them. Every call goes through its link (releases riding on it, the KV ledger, the deadline), is
    traced by `tracing` and recorded for the metrics and the step trace."""

    def __init__(
        self,
        target_address: str,
        draft_address: str | None,
        *,
        tracing: StepTracing | None = None,
        step_streams: bool = True,
        channel: str = "auto",
        channel_setup_timeout: float = 60.0,
        draft_timeout: float | None = 30.0,
        target_timeout: float | None = 120.0,
        retry_interval: float = 5.0,
        keepalive: float = 5.0,
        metrics: CoordinatorMetrics | None = None,
        record_events: bool = False,
        call_started: Callable[[], None] | None = None,
        health: Health | None = None,
        wake: asyncio.Event | None = None,
        open_requests: Callable[[], int] = lambda: 0,
        tls: ClientTls | None = None,
        stubs: tuple[Any, Any] | None = None,
    ) -> None:
        """`channel`: the data plane asked for ("auto": `choose_channel`'s), whose set-up fails after
        `channel_setup_timeout` seconds (`Pair`). A draft call that outlives
        `draft_timeout` is a lost draft (a hung process must not stall the target's decoding), a target call that
        outlives `target_timeout` a lost target (None: no deadline); a lost worker is tried again every
        `retry_interval` seconds; a worker that answers no keepalive ping for `keepalive` seconds is lost (a
        stopped process, whatever call waits on it). `record_events`: keep a `StepEvent` per call. `call_started`:
        told as a call is made that the step's GPU work waits on, a target call or one made while one runs (the step
        loop's outbox: the clients' stream handlers run meanwhile); not a proposal made alone: it is a step's
        shortest call, and its reply is what the verify that follows waits for. `health`: the coordinator's, which
        follows the target's. `open_requests`: how many requests the coordinator has open, for the log. `tls`: mTLS
        to both workers (None: plaintext)."""
        self.tracing = tracing if tracing is not None else StepTracing()
        self.metrics = metrics
        self.record_events = record_events
        self.events: list[StepEvent] = []
        self._call_started = call_started
        # One owner id per coordinator process: the workers' leases name it (`Pair.take_lease`).
        owner = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        tickets = {"target": Ticket(owner), "draft": Ticket(owner)}
        interceptors = self.tracing.interceptors()
        options = worker_channel_options(keepalive)

        def dial(address: str, ticket: Ticket) -> grpc.aio.Channel:
            return aio_channel(address, tls, options, [*interceptors, *presenting(ticket)])

        target_channel = dial(target_address, tickets["target"])
        target = target_pb2_grpc.TargetServiceStub(target_channel) if stubs is None else stubs[0]
        target_stream = StepStream(target.VerifyStream, target_pb2.VerifyStreamRequest) if step_streams else None
        self.target = WorkerLink(
            "target", target_channel, target, target_stream, target_timeout, TARGET_LATE_FLOOR_S, self._made
        )
        draft_channel = dial(draft_address, tickets["draft"]) if draft_address else None
        draft = None if draft_channel is None else stubs[1] if stubs else draft_pb2_grpc.DraftServiceStub(draft_channel)
        draft_stream = (
            StepStream(draft.ProposeStream, draft_pb2.ProposeStreamRequest) if step_streams and draft else None
        )
        self.draft = WorkerLink(
            "draft", draft_channel, draft, draft_stream, draft_timeout, DRAFT_LATE_FLOOR_S, self._made
        )
        endpoints = (target_address, draft_address or "none")
        # Set up at start-up (`Coordinator.start`).
        # Per batch: the target's states of its last verify, for its next proposal (`draft_reads_target`)
        self._to_draft: dict[int, common_pb2.TargetPayload] = {}
        self.pair = Pair(target, draft, channel, tickets, endpoints, channel_setup_timeout)
        self.failover = Failover(
            self.target,
            self.draft,
            self.pair,
            health if health is not None else Health(),
            wake if wake is not None else asyncio.Event(),
            retry_interval,
            open_requests,
        )

    @property
    def has_draft(self) -> bool:
        """Whether a draft service is configured (not ar), in use or not."""
        return self.draft.state is not LinkState.ABSENT

    def free_blocks(self, k: int) -> dict[str, tuple[int, int]]:
        """Per worker in use that accounts blocks: (blocks free by the ledger, blocks one sequence's step of k drafts
        may take)."""
        links = (self.target, self.draft) if self.draft.connected and k else (self.target,)
        return {link.name: (link.ledger.free, link.ledger.for_tokens(k + 2)) for link in links if link.ledger.accounted}

    def ledger(self, worker: str) -> BlockLedger:
        """The `BlockLedger` of "target" or "draft"."""
        return self.target.ledger if worker == "target" else self.draft.ledger

    def _made(self) -> None:
        """A call was sent: the outbox may flush if the step's GPU work waits on it (a target call in flight)."""
        if self._call_started is not None and self.target.calls_in_flight:
            self._call_started()

    def _record(
        self, kind: str, batch_id: int, size: int, start: float, timings: common_pb2.Timings, k: int = 0
    ) -> None:
        end = time.perf_counter()
        if self.metrics is not None:
            self.metrics.worker_call(kind, size, start, end)
        if self.record_events:
            worker_s = timings.end_unix_s - timings.start_unix_s
            self.events.append(
                StepEvent(
                    kind, batch_id, size, start, end, timings.compute_s, timings.channel_s, timings.queue_s, worker_s, k
                )
            )

    # ----------------------------------------------------------------------------------------------- calls

    async def prefill_target(self, requests: Sequence[RequestState]) -> target_pb2.TargetServicePrefillResponse:
        start = time.perf_counter()
        specs = [sequence_spec(r) for r in requests]
        link = self.target
        blocks = sum(link.ledger.for_prompt(len(s.prompt_token_ids)) for s in specs)
        with self.tracing.call("prefill", "target", requests) as span:
            reply = await link.call(
                lambda released: link.stub.Prefill(
                    target_pb2.TargetServicePrefillRequest(sequences=specs, release_seq_ids=released),
                    timeout=link.timeout,
                ),
                blocks,
            )
            self.tracing.replied(span, reply)
        self._record("prefill", -1, len(requests), start, reply.timings)
        return reply

    @property
    def draft_reads_target(self) -> bool:
        """Whether the draft reads the target's hidden states (an EAGLE head): its prefill waits for the target's,
        and each proposal carries its batch's last verify's states."""
        return self.pair.draft_info.reads_target_states

    async def prefill_draft(
        self,
        requests: Sequence[RequestState],
        resume: bool = False,
        from_target: common_pb2.TargetPayload | None = None,
    ) -> None:
        """The draft's prefill (`from_target`: the target's prefill's states for it); with `resume`, a draft back
        after a loss: states kept for a proposal may name buffers of the channel it had, so they go."""
        if resume:
            self._to_draft.clear()
        specs = [sequence_spec(r, resume) for r in requests]
        link = self.draft
        blocks = sum(link.ledger.for_prompt(len(s.prompt_token_ids)) for s in specs)

        def request(released: list[int]) -> draft_pb2.DraftServicePrefillRequest:
            message = draft_pb2.DraftServicePrefillRequest(sequences=specs, release_seq_ids=released)
            if from_target is not None:
                message.from_target.CopyFrom(from_target)
            return message

        with self.tracing.call("prefill", "draft", requests, resume=resume):
            await link.call(lambda released: link.stub.Prefill(request(released), timeout=link.timeout), blocks)

    async def propose(
        self, step_id: int, batch_id: int, members: Sequence[RequestState], k: int, verify_token_budget: int = 0
    ) -> draft_pb2.ProposeResponse:
        """k drafts a row (`verify_token_budget`: TETRIS's selection over them, ProposeRequest's)."""
        link = self.draft
        assert link.connected
        start = time.perf_counter()
        request = draft_pb2.ProposeRequest(
            step_id=step_id,
            batch_id=batch_id,
            seq_ids=[r.seq_id for r in members],
            num_accepted=[r.decode.num_accepted for r in members],
            next_token_ids=[r.last_token for r in members],
            num_draft_tokens=k,
            verify_token_budget=verify_token_budget,
        )
        states = self._to_draft.pop(batch_id, None)
        if states is not None:  # (a draft that reads the target's states: its batch's last verify's)
            request.from_target.CopyFrom(states)
        missed = [r.missed_by_draft for r in members]
        if any(missed):  # (after steps decoded without drafts)
            request.num_missed_tokens.extend(len(m) for m in missed)
            request.missed_token_ids.extend(t for m in missed for t in m)

        blocks = len(members) * link.ledger.for_tokens(k + 2)
        return await self._step_call("propose", link, link.stub.Propose, request, members, k, blocks, start)

    async def verify(
        self,
        step_id: int,
        batch_id: int,
        members: Sequence[RequestState],
        drafts: common_pb2.DraftPayload | None,
        k: int,
    ) -> target_pb2.VerifyResponse:
        link = self.target
        start = time.perf_counter()
        request = target_pb2.VerifyRequest(
            step_id=step_id, batch_id=batch_id, seq_ids=[r.seq_id for r in members], num_draft_tokens=k
        )
        if drafts is not None:
            request.drafts.CopyFrom(drafts)

        blocks = len(members) * link.ledger.for_tokens(k + 1)
        reply: target_pb2.VerifyResponse = await self._step_call(
            "verify", link, link.stub.Verify, request, members, k, blocks, start
        )
        if reply.HasField("to_draft"):  # for the batch's next proposal
            self._to_draft[batch_id] = reply.to_draft
        return reply

    async def _step_call(
        self,
        kind: str,
        link: WorkerLink,
        unary: Callable[..., Awaitable[Step]],
        request: Any,
        members: Sequence[RequestState],
        k: int,
        blocks: int,
        start: float,
    ) -> Step:
        """A Propose or Verify through `link` (made from `start`): releases ride on it, `blocks` are counted until its
        reply, it is traced, and its time goes to the link's deadline and the step record."""

        def send(released: list[int]) -> Awaitable[Step]:
            request.release_seq_ids.extend(released)
            return link.step_call(unary, request, self.tracing.trace_context())

        attributes = {"step_id": request.step_id, "batch_id": request.batch_id, "num_draft_tokens": k}
        with self.tracing.call(kind, link.name, members, **attributes) as span:
            reply = await link.call(send, blocks)
            self.tracing.replied(span, reply)
        link.deadline.record(time.perf_counter() - start)
        self._record(kind, request.batch_id, len(members), start, reply.timings, k)
        return reply

    def release_later(self, seq_ids: Sequence[int]) -> None:
        """Free the rows of `seq_ids` on both workers with the next call to each (a round trip saved per step that
        finishes a request); `flush_releases` sends what no call took."""
        self.tracing.released(seq_ids)
        self.target.release_later(list(seq_ids))
        if self.draft.connected:  # a lost draft's rows are freed when it is back (`Failover.draft_backlog`)
            self.draft.release_later(list(seq_ids))

    async def flush_releases(self, always: bool = False) -> grpc.RpcError | None:
        """Release calls for what no other call took, on both workers at once (`always`: even with nothing to
        release, so that their free-slots gauges are current). A failure on the target raises; one on the draft is
        returned, for the step loop to decide whether the draft is lost."""

        async def on_target() -> None:
            link = self.target
            if always or link.has_unreleased:
                await link.call(
                    lambda released: link.stub.Release(
                        target_pb2.TargetServiceReleaseRequest(seq_ids=released), timeout=link.timeout
                    )
                )

        async def on_draft() -> grpc.RpcError | None:
            link = self.draft
            if not link.connected or not (always or link.has_unreleased):
                return None
            try:
                await link.call(
                    lambda released: link.stub.Release(
                        draft_pb2.DraftServiceReleaseRequest(seq_ids=released), timeout=link.timeout
                    )
                )
            except grpc.RpcError as exc:
                return exc
            return None

        draft_error, _ = await asyncio.gather(on_draft(), on_target())
        return draft_error

    async def close(self) -> None:
        self.failover.stop()
        await self.pair.give_up_leases()
        await self.target.close()
        await self.draft.close()
