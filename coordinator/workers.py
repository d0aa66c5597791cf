"""The two workers as the coordinator holds them: connections, health and failover, and the calls of the steps."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar, cast

import grpc
from grpc_health.v1 import health_pb2

from coordinator.call_deadlines import CallDeadline
from coordinator.health_watch import follow_health
from coordinator.kv_blocks import BlockLedger
from coordinator.pairing import Pair, call_detail
from coordinator.request_state import RequestState
from minedraft.errors import ModelLoadError
from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, target_pb2, target_pb2_grpc
from minedraft.rpc.lease import Ticket, presenting
from minedraft.rpc.security import ClientTls, aio_channel
from minedraft.rpc.server_utils import CHANNEL_OPTIONS, Health
from minedraft.rpc.step_stream import StepStream

if TYPE_CHECKING:
    from minedraft.observability.metrics import CoordinatorMetrics

Call = TypeVar("Call")
Reply = TypeVar("Reply")
log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
# Target call failures that mean the target is gone or has restarted (its sequences, and its channel, lost)
TARGET_LOST_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
)
# A step call later than this many times its median is hung (`CallDeadline`), but never sooner than the floor: a
# late proposal costs the step only the floor (the target goes on alone), a late verify the whole target.
LATE_FACTOR = 20.0
DRAFT_LATE_FLOOR_S = 1.0
TARGET_LATE_FLOOR_S = 10.0
# Draft call failures that mean the draft is unreachable or hung
DRAFT_LOST_CODES = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,  # its lease lost: what it held is gone
)


class TargetState(enum.Enum):
    """The target service as the coordinator sees it."""

    SERVING = "serving"
    DRAINING = "draining"  # it says it is stopping: nothing new is admitted, what was admitted finishes on it
    LOST = "lost"  # unreachable, hung or restarted: its sequences are gone; tried again every retry interval


class DraftState(enum.Enum):
    """The draft service as the coordinator sees it."""

    ABSENT = "absent"  # ar: no draft service
    CONNECTED = "connected"  # steps draft on it
    LOST = "lost"  # unreachable, hung or left: the target decodes alone; tried again every retry interval
    PROBING = "probing"  # being tried again in the background (GetInfo, then the channel set-up)
    HANDING_OVER = "handing over"  # answered a probe: takes the running requests between steps, then drafts


class Refusal(NamedTuple):
    """Why a new request is refused: `reason` for the metrics, `message` for its client (UNAVAILABLE)."""

    reason: str
    message: str


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
    params.max_tokens = (
        request.config.max_tokens - request.resumed_output
    )  # less the output it had when preempted, now prompt
    tokens = request.prompt_ids + request.output_ids[:-1] if resume else request.prefill_ids
    output = len(tokens) - len(request.prompt_ids)  # penalties and min_tokens count these as output
    return common_pb2.SequenceSpec(seq_id=request.seq_id, prompt_token_ids=tokens, params=params, output_tokens=output)


class Workers:
    """The target and draft services as the coordinator holds them, and the one owner of what it knows of them:
    each one's connection and health (`TargetState`, `DraftState`, and whether the draft says it is stopping), the
    pair they make (`pair`: what they reported, the channel between them), and the sequences still to be released
    on each (`release_later`; a lost draft's `draft_backlog`). The draft is absent in ar mode.

    Its state changes only through its own methods: the step loop reports what its calls raised (`lose_target_on`,
    `lose_draft_on`) and asks between steps what to do (`leave_draft_if_asked`, `probe_draft`, `hand_over_draft`,
    `take_target_back`); the workers' health streams (`watch_health`) and the coordinator's drain (`drain`) reach it
    directly. It tells the step loop through `wake`, the event the step loop waits on: a target lost, a draft to
    try at once.
    """

    def __init__(
        self,
        target_address: str,
        draft_address: str | None,
        *,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        step_streams: bool = True,
        channel: str = "auto",
        draft_timeout: float | None = 30.0,
        target_timeout: float | None = 120.0,
        retry_interval: float = 5.0,
        metrics: CoordinatorMetrics | None = None,
        record_events: bool = False,
        call_started: Callable[[], None] | None = None,
        health: Health | None = None,
        wake: asyncio.Event | None = None,
        open_requests: Callable[[], int] = lambda: 0,
        tls: ClientTls | None = None,
    ) -> None:
        """`channel`: the data plane asked for ("auto": `choose_channel`'s). A draft call that outlives
        `draft_timeout` is a lost draft (a hung process must not stall the target's decoding), a target call that
        outlives `target_timeout` a lost target (None: no deadline); a lost worker is tried again every
        `retry_interval` seconds. `record_events`: keep a `StepEvent` per call. `call_started`: told as a call is made
        that the step's GPU work waits on, a target call or one made while one runs (the step loop's outbox: the
        clients' stream handlers run meanwhile); not a proposal made alone: it is a step's shortest call, and its
        reply is what the verify that follows waits for. `health`: the coordinator's, which follows the target's.
        `open_requests`: how many requests the coordinator has open, for the log. `tls`: mTLS to both workers
        (None: plaintext)."""
        self.draft_timeout, self.target_timeout = draft_timeout, target_timeout
        self._step_deadlines = {
            "draft": CallDeadline(LATE_FACTOR, DRAFT_LATE_FLOOR_S, draft_timeout),
            "target": CallDeadline(LATE_FACTOR, TARGET_LATE_FLOOR_S, target_timeout),
        }
        self.retry_interval = retry_interval
        self.metrics = metrics
        self.record_events = record_events
        self.events: list[StepEvent] = []
        self._call_started = call_started
        self._health = health if health is not None else Health()
        self._wake = wake if wake is not None else asyncio.Event()
        self._open_requests = open_requests

        # One owner id per coordinator process: the workers' leases name it (`Pair.take_lease`).
        owner = f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"
        tickets = {"target": Ticket(owner), "draft": Ticket(owner)}
        self._channels = [
            aio_channel(target_address, tls, CHANNEL_OPTIONS, [*interceptors, *presenting(tickets["target"])])
        ]
        self._target_channel = self._channels[0]
        self._target = target_pb2_grpc.TargetServiceStub(self._target_channel)
        self._draft: draft_pb2_grpc.DraftServiceStub | None = None
        self._draft_channel: grpc.aio.Channel | None = None
        if draft_address:
            self._draft_channel = aio_channel(
                draft_address, tls, CHANNEL_OPTIONS, [*interceptors, *presenting(tickets["draft"])]
            )
            self._channels.append(self._draft_channel)
            self._draft = draft_pb2_grpc.DraftServiceStub(self._draft_channel)
        # Verify and Propose as messages on a stream per worker (`StepStream`), unless unary calls are asked for.
        self.verify_stream = (
            StepStream(self._target.VerifyStream, target_pb2.VerifyStreamRequest) if step_streams else None
        )
        self.propose_stream = (
            StepStream(self._draft.ProposeStream, draft_pb2.ProposeStreamRequest)
            if step_streams and self._draft is not None
            else None
        )

        self.pair = Pair(self._target, self._draft, channel, tickets)  # set up at start-up (`GenerationServicer.start`)

        self._target_state = TargetState.SERVING
        self._draft_state = DraftState.ABSENT if self._draft is None else DraftState.CONNECTED
        self._draft_stopping = False  # the draft's health says NOT_SERVING: not used, nor taken back, while it does
        self._draining = False  # the coordinator drains (`drain`)
        self._leave_reason: str | None = None  # why the draft is to be left at the next step (`leave_draft`)
        self._draft_short_of_room = False  # the draft was left for want of room once (`lose_draft_on`)
        self._draft_probe: asyncio.Task[bool] | None = None
        self._next_probe = 0.0  # (time.monotonic)
        self._watches: list[asyncio.Task[None]] = []  # `follow_health` of each worker
        self._reports: set[asyncio.Future[None]] = set()  # health reports in flight (`_lose_target`)

        self._target_calls = 0  # in flight
        # Sequences to release on each worker, sent with the next call to it (`release_later`).
        self._unreleased: dict[str, list[int]] = {"target": [], "draft": []}
        self._draft_backlog: list[int] = []  # what the draft may still hold after a loss: released when it is back
        self.kv_blocks = {"target": BlockLedger(), "draft": BlockLedger()}  # (`reset_kv_blocks`)

    # ----------------------------------------------------------------------------------------------- state

    def reset_kv_blocks(self) -> None:
        """What the workers reported of their KV blocks at the pair's set-up (again after a loss)."""
        for name, info in (("target", self.pair.target_info), ("draft", self.pair.draft_info)):
            self.kv_blocks[name].reset(info.block_size, info.num_blocks, info.free_blocks, info.prefix_caching)

    def free_blocks(self, k: int) -> dict[str, tuple[int, int]]:
        """Per worker in use that accounts blocks: (blocks free by the ledger, blocks one sequence's step of k drafts
        may take)."""
        names = ("target", "draft") if self.draft_connected and k else ("target",)
        ledgers = {name: self.kv_blocks[name] for name in names}
        return {name: (ledger.free, ledger.for_tokens(k + 2)) for name, ledger in ledgers.items() if ledger.accounted}

    @contextlib.contextmanager
    def _taking(self, worker: str, blocks: int) -> Iterator[Callable[[int], None]]:
        """Around a call to `worker` that may take `blocks`: the ledger counts them until the reply, whose reported
        free blocks the caller passes to what this yields."""
        ledger = self.kv_blocks[worker]
        ledger.sent(blocks)
        free: list[int] = []
        try:
            yield free.append
        finally:
            ledger.answered(blocks, free[-1] if free and ledger.accounted else None)

    @property
    def target_lost(self) -> bool:
        return self._target_state is TargetState.LOST

    @property
    def draft_connected(self) -> bool:
        """Whether steps draft: a draft service is configured and in use."""
        return self._draft_state is DraftState.CONNECTED

    @property
    def _draft_in_use(self) -> draft_pb2_grpc.DraftServiceStub | None:
        """The draft's stub while steps draft on it."""
        return self._draft if self._draft_state is DraftState.CONNECTED else None

    @property
    def has_draft(self) -> bool:
        """Whether a draft service is configured (not ar), in use or not."""
        return self._draft is not None

    @property
    def draft_backlog(self) -> tuple[int, ...]:
        return tuple(self._draft_backlog)

    def refusal(self) -> Refusal | None:
        """Why a new request is refused now, or None: it is admitted."""
        if self._draining:
            return Refusal(
                "draining", "this coordinator is shutting down: send the request to another replica or retry"
            )
        if self._target_state is TargetState.LOST:
            return Refusal(
                "target_lost",
                "the target service is unreachable; the coordinator "
                f"tries it again every {self.retry_interval:g} s: retry shortly",
            )
        if self._target_state is TargetState.DRAINING:
            return Refusal(
                "target_draining",
                "the target service is shutting down; the coordinator "
                "finishes the requests it admitted and serves again once a new one is up: retry shortly",
            )
        return None

    # ----------------------------------------------------------------------------------------------- health

    def keep_leases(self) -> None:
        """Renew both workers' leases (`_renew_leases`) from now until `stop_failover`: once they are taken, before
        the workers' start-up work (a Prepare can outlast a lease)."""
        self._watches.append(asyncio.create_task(self._renew_leases()))

    def watch_health(self) -> None:
        """Follow both workers' health (`follow_health`) until `stop_failover`."""
        self._watches.append(
            asyncio.create_task(
                follow_health(self._target_channel, "target", self.retry_interval, self._target_said, self._lose_target)
            )
        )
        if self._draft_channel is not None:
            self._watches.append(
                asyncio.create_task(follow_health(self._draft_channel, "draft", self.retry_interval, self._draft_said))
            )

    async def _renew_leases(self) -> None:
        """The leases' heartbeat, three times a lease's life: a lease another coordinator took meanwhile (this one
        was paused past it) loses that worker; an unanswered one is left to the health streams and the calls."""
        while True:
            tickets = self.pair.tickets
            ttl = min((t.ttl_s for t in tickets.values() if t.epoch), default=0.0)
            await asyncio.sleep(ttl / 3 if ttl else self.retry_interval)
            for worker in ("target", "draft"):
                if not tickets[worker].epoch or (worker == "draft" and not self.draft_connected):
                    continue
                if worker == "target" and self._target_state is TargetState.LOST:
                    continue
                try:
                    await self.pair.renew_lease(worker, timeout=max(tickets[worker].ttl_s / 3, 0.5))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        continue
                    if worker == "target":
                        self._lose_target(f"its lease lost: {exc.details()}")
                    else:
                        self.leave_draft(f"the draft's lease lost: {exc.details()}")

    async def _target_said(self, stopping: bool) -> None:
        """The target's health said `stopping` (NOT_SERVING: a SIGTERM alone, as when its pod is replaced; it serves
        its calls on until none has come for a while, or its drain timeout): admit nothing new, so that what was
        admitted finishes on it and it can stop; once its stream ends it is lost, and the step loop takes the new
        one back. Admitting on would keep it busy until its drain timeout cut every request off."""
        if stopping and self._target_state is TargetState.SERVING:
            log.warning(
                "the target service is shutting down: admitting nothing new until it is back; "
                "%d requests to finish on it",
                self._open_requests(),
            )
            self._target_state = TargetState.DRAINING
            await self._report_health(serving=False)
        elif not stopping and self._target_state is TargetState.DRAINING:
            self._target_state = TargetState.SERVING

    async def _draft_said(self, stopping: bool) -> None:
        """The draft's health said `stopping`: stop drafting at once (the target decodes alone), so that the draft
        goes quiet and stops long before its drain timeout, and take no draft back through this address while it
        says so (the old process still answers there); drafting on would keep a draft replaced alone busy until its
        drain timeout, then lose it in the middle of a call. While the coordinator drains too (a whole release
        deleted), the stopping draft drafts on for what is left: it serves as long as calls come."""
        was_stopping, self._draft_stopping = self._draft_stopping, stopping
        if self._refusing_stopping_draft and not was_stopping:
            self.leave_draft("the draft service is shutting down")

    @property
    def _refusing_stopping_draft(self) -> bool:
        """Whether the draft says it is stopping and is neither used nor taken back through its address (the old
        process still answers there); while the coordinator drains too, it drafts on."""
        return self._draft_stopping and not self._draining

    async def _report_health(self, serving: bool) -> None:
        """The coordinator's health: NOT_SERVING while the target cannot take requests, so that a load balancer
        sends them elsewhere."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", GENERATION_SERVICE):
            await self._health.set(name, status)

    async def drain(self) -> None:
        """The coordinator drains: health NOT_SERVING for good and nothing new admitted (`refusal`); a draft that
        began stopping drafts on for what is left, tried at once (it may still answer, and drafts finish the drain
        sooner)."""
        self._draining = True
        await self._health.drain()
        if self._draft_stopping:
            self._next_probe = 0.0
            self._wake.set()

    def stop_failover(self) -> None:
        """The coordinator stops: follow no worker's health, and try no lost draft, any more."""
        for task in self._watches:
            task.cancel()
        if self._draft_probe is not None:
            self._draft_probe.cancel()

    # ----------------------------------------------------------------------------------------------- the draft

    def lose_draft_on(self, exc: BaseException, held: Iterable[int]) -> bool:
        """Whether `exc`, from a draft call, means the draft is unreachable, hung or out of room (RESOURCE_EXHAUSTED:
        its KV cache or rows cannot take the call's sequences); if so it is left (`held`: what it may hold, the
        batches' sequences): a draft lost, or short of memory, costs speed, not requests."""
        if not isinstance(exc, grpc.aio.AioRpcError):
            return False
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            # Routine when the draft's cache is the smaller: said at WARNING the first time, at INFO after.
            level = logging.INFO if self._draft_short_of_room else logging.WARNING
            self._draft_short_of_room = True
            reason = (
                f"the draft service has no room for the sequences the target holds ({exc.details()}); it takes them "
                "back once its probe finds room for every running request (a larger --kv-cache-memory on the draft "
                "keeps it drafting)"
            )
            self._drop_draft(reason, held, level)
            return True
        if exc.code() not in DRAFT_LOST_CODES:
            return False
        self._drop_draft(f"draft service unreachable ({exc.details()})", held)
        return True

    def leave_draft(self, reason: str) -> None:
        """Leave the draft at the next step (`leave_draft_if_asked`), not in the middle of one that has decided to
        call it (it would find no draft to call)."""
        self._leave_reason = reason

    def leave_draft_if_asked(self, held: Iterable[int]) -> None:
        """At the start of a step: leave the draft if `leave_draft` asked to since the last one."""
        if self._leave_reason is not None:
            self._drop_draft(self._leave_reason, held)
            self._leave_reason = None

    def _drop_draft(self, reason: str, held: Iterable[int], level: int = logging.ERROR) -> None:
        """Decode with the target alone from now on (`reason` says why, in the log at `level`) until the draft is
        back (`probe_draft`); drafts already made are still verified."""
        if self._draft_state is DraftState.CONNECTED:
            log.log(level, "%s: continuing with the target alone", reason)
            self._draft_state = DraftState.LOST
            # Only what was admitted by now can be on the draft (at most its slots), whatever ends meanwhile.
            self._draft_backlog = [*held, *self._unreleased["draft"]]
            self._unreleased["draft"] = []

    def probe_draft(self) -> bool:
        """Between steps, while the draft is lost: try it in the background when a try is due (every retry interval),
        so that a hung draft, or one capturing its CUDA graphs at the connect, never stalls the steps; whether a
        try found it back, ready for `hand_over_draft`."""
        probe = self._draft_probe
        if self._draft_state is DraftState.PROBING and probe is not None and probe.done():
            self._draft_probe = None
            back = not probe.cancelled() and probe.exception() is None and probe.result()
            self._draft_state = DraftState.HANDING_OVER if back else DraftState.LOST  # (tried again when due)
            return back
        if self._draft_state is DraftState.LOST and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + self.retry_interval
            self._draft_probe = asyncio.create_task(self._draft_answers())
            self._draft_state = DraftState.PROBING
        return self._draft_state is DraftState.HANDING_OVER

    async def _draft_answers(self) -> bool:
        """A probe: whether the draft answers a GetInfo within 2 s and then takes the channel set-up, which can be
        long (a restarted draft on a GPU captures its CUDA graphs then: 20-30 s for a 1B draft)."""
        if self._refusing_stopping_draft:
            return False
        try:
            await self.pair.set_up_draft_again()
            self.reset_kv_blocks()
        except (grpc.RpcError, ModelLoadError, ValueError) as exc:
            log.info("draft service not back yet: %s", call_detail(exc))
            return False
        await self._reopen_streams(self.propose_stream)
        return True

    @staticmethod
    async def _reopen_streams(*streams: StepStream | None) -> None:
        """After a new lease: the next step call opens a new stream, which presents it (a stream presents the lease
        it was opened under)."""
        for stream in streams:
            if stream is not None:
                await stream.close()

    async def hand_over_draft(self, running: Sequence[RequestState]) -> None:
        """Once `probe_draft` found the draft back, between steps with no drafts in flight: release what it may
        still hold, hand it every running request (prompt and output so far) and draft again."""
        draft = self._draft
        assert draft is not None and self._draft_state is DraftState.HANDING_OVER
        if self._refusing_stopping_draft:  # it began stopping after the probe: a later probe takes the next one
            self._draft_state = DraftState.LOST
            return
        try:
            # A draft that was only unreachable still holds what was admitted before it was lost.
            stale = sorted(set(self._draft_backlog) | {r.seq_id for r in running})
            await draft.Release(draft_pb2.DraftServiceReleaseRequest(seq_ids=stale), timeout=self.draft_timeout)
            if running:
                await self.prefill_draft(running, resume=True)
        except grpc.RpcError as exc:
            log.info("draft service not back yet: %s", call_detail(exc))
            self._draft_state = DraftState.LOST
            return
        self._draft_backlog = []
        self._draft_state = DraftState.CONNECTED
        log.warning("draft service back: speculative decoding again (%d running requests handed over)", len(running))

    # ----------------------------------------------------------------------------------------------- the target

    def lose_target_on(self, exc: BaseException) -> bool:
        """Whether `exc`, from a target call, means the target is unreachable, hung or restarted; if so it is lost."""
        if not (isinstance(exc, grpc.aio.AioRpcError) and exc.code() in TARGET_LOST_CODES):
            return False
        self._lose_target(f"{exc.code().name}: {exc.details()}")
        return True

    def _lose_target(self, reason: str) -> None:
        """The target has lost every sequence it held: the step loop fails every open request (UNAVAILABLE: their
        clients may send them again), and nothing is admitted until `take_target_back` finds it back."""
        if self._target_state is not TargetState.LOST:
            log.error("target service lost (%s): failing every request until it is back", reason)
            self._target_state = TargetState.LOST
            self._wake.set()  # an idle loop reconnects at once
            # NOT_SERVING before the failed requests' clients hear of it: a load balancer moves on at once.
            report = asyncio.ensure_future(self._report_health(serving=False))
            self._reports.add(report)
            report.add_done_callback(self._reports.discard)

    async def report_target_lost(self) -> None:
        """Health NOT_SERVING while the target is lost."""
        await self._report_health(serving=False)

    async def take_target_back(self) -> bool:
        """While the target is lost (the step loop's, every retry interval): whether it answers a GetInfo within 2 s,
        serves a model the draft still pairs with, and takes the channel set-up again; if so it serves (health
        follows with `report_target_back`)."""
        try:
            await self.pair.set_up_target_again(with_draft=self.draft_connected)
            self.reset_kv_blocks()
        except (grpc.RpcError, ModelLoadError, ValueError) as exc:
            log.info("target service not back yet: %s", call_detail(exc))
            return False
        await self._reopen_streams(self.verify_stream, self.propose_stream if self.draft_connected else None)
        self._target_state = TargetState.SERVING
        return True

    async def report_target_back(self) -> None:
        """Once the target is back and what the lost one held is released: health SERVING."""
        log.warning("target service back: serving again")
        await self._report_health(serving=True)

    # ----------------------------------------------------------------------------------------------- calls

    def _started(self, call: Call) -> Call:
        if self._call_started is not None and self._target_calls:
            self._call_started()
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
        self.stop_failover()
        await self.pair.give_up_leases()
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
        specs = [sequence_spec(r) for r in requests]
        blocks = sum(self.kv_blocks["target"].for_prompt(len(s.prompt_token_ids)) for s in specs)
        with self._releasing("target") as released, self._on_target(), self._taking("target", blocks) as report:
            reply = await self._started(
                self._target.Prefill(
                    target_pb2.TargetServicePrefillRequest(sequences=specs, release_seq_ids=released),
                    timeout=self.target_timeout,
                )
            )
            report(reply.free_blocks)
        self._record("prefill", -1, len(requests), start, reply.timings)
        return reply

    async def prefill_draft(self, requests: Sequence[RequestState], resume: bool = False) -> None:
        assert self._draft is not None
        specs = [sequence_spec(r, resume) for r in requests]
        blocks = sum(self.kv_blocks["draft"].for_prompt(len(s.prompt_token_ids)) for s in specs)
        with self._releasing("draft") as released, self._taking("draft", blocks) as report:
            reply = await self._started(
                self._draft.Prefill(
                    draft_pb2.DraftServicePrefillRequest(sequences=specs, release_seq_ids=released),
                    timeout=self.draft_timeout,
                )
            )
            report(reply.free_blocks)
        if resume:
            for request in requests:
                request.draft_from = len(request.output_ids) - 1

    async def propose(
        self, step_id: int, batch_id: int, members: Sequence[RequestState], k: int
    ) -> draft_pb2.ProposeResponse:
        draft = self._draft_in_use
        assert draft is not None
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
        blocks = len(members) * self.kv_blocks["draft"].for_tokens(k + 2)
        with self._releasing("draft") as released, self._taking("draft", blocks) as report:
            request.release_seq_ids.extend(released)
            reply = await self._started(
                self._step_call(self.propose_stream, draft.Propose, request, self._step_deadlines["draft"].timeout())
            )
            report(reply.free_blocks)
        self._step_deadlines["draft"].record(time.perf_counter() - start)
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
        blocks = len(members) * self.kv_blocks["target"].for_tokens(k + 1)
        with self._releasing("target") as released, self._on_target(), self._taking("target", blocks) as report:
            request.release_seq_ids.extend(released)
            reply = await self._started(
                self._step_call(
                    self.verify_stream, self._target.Verify, request, self._step_deadlines["target"].timeout()
                )
            )
            report(reply.free_blocks)
        self._step_deadlines["target"].record(time.perf_counter() - start)
        self._record("verify", batch_id, len(members), start, reply.timings, k)
        return reply

    def release_later(self, seq_ids: Sequence[int]) -> None:
        """Free the rows of `seq_ids` on both workers with the next call to each (a round trip saved per step that
        finishes a request); `flush_releases` sends what no call took."""
        self._unreleased["target"] += seq_ids
        if self.draft_connected:  # a lost draft's rows are freed when it is back (`draft_backlog`)
            self._unreleased["draft"] += seq_ids

    @contextlib.contextmanager
    def _releasing(self, worker: str) -> Iterator[list[int]]:
        """The releases a call to `worker` carries; put back if the call fails (releasing is idempotent)."""
        released, self._unreleased[worker] = self._unreleased[worker], []
        try:
            yield released
        except BaseException:
            self._unreleased[worker] = released + self._unreleased[worker]
            raise

    async def flush_releases(self, always: bool = False) -> grpc.RpcError | None:
        """Release calls for what no other call took, on both workers at once (`always`: even with nothing to
        release, so that their free-slots gauges are current). A failure on the target raises; one on the draft is
        returned, for the step loop to decide whether the draft is lost."""

        async def on_target() -> None:
            if always or self._unreleased["target"]:
                with self._releasing("target") as released, self._on_target(), self._taking("target", 0) as report:
                    reply = await self._started(
                        self._target.Release(
                            target_pb2.TargetServiceReleaseRequest(seq_ids=released), timeout=self.target_timeout
                        )
                    )
                    report(reply.free_blocks)

        async def on_draft() -> grpc.RpcError | None:
            draft = self._draft_in_use
            if draft is None or not (always or self._unreleased["draft"]):
                return None
            try:
                with self._releasing("draft") as released, self._taking("draft", 0) as report:
                    reply = await self._started(
                        draft.Release(
                            draft_pb2.DraftServiceReleaseRequest(seq_ids=released), timeout=self.draft_timeout
                        )
                    )
                    report(reply.free_blocks)
            except grpc.RpcError as exc:
                return exc
            return None

        draft_error, _ = await asyncio.gather(on_draft(), on_target())
        return draft_error
