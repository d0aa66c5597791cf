"""What the coordinator does as its workers come and go: refusal, loss, probing, hand-over, health and drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import NamedTuple

import grpc
from grpc_health.v1 import health_pb2

from coordinator.call_errors import lost_reason
from coordinator.liveness import Liveness
from coordinator.pairing import Pair, call_detail
from coordinator.request_state import RequestState
from coordinator.worker_link import LinkState, WorkerLink
from minedraft.errors import ModelLoadError
from minedraft.proto import draft_pb2, generation_pb2
from minedraft.rpc.server_utils import Health

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name


class Refusal(NamedTuple):
    """Why a new request is refused: `reason` for the metrics, `message` for its client (UNAVAILABLE)."""

    reason: str
    message: str


def refusal_of(draining: bool, target: WorkerLink, retry_interval: float) -> Refusal | None:
    """Why a new request is refused while the coordinator is `draining` or not and `target` is as it is, or None."""
    if draining:
        return Refusal("draining", "this coordinator is shutting down: send the request to another replica or retry")
    if target.state is LinkState.LOST:
        return Refusal(
            "target_lost",
            "the target service is unreachable; the coordinator "
            f"tries it again every {retry_interval:g} s: retry shortly",
        )
    if target.stopping:
        return Refusal(
            "target_draining",
            "the target service is shutting down; the coordinator "
            "finishes the requests it admitted and serves again once a new one is up: retry shortly",
        )
    return None


class Failover:
    """The one writer of both links' state (`WorkerLink.state`, `stopping`) and of what follows from it: whether
    new requests are refused, the target lost and taken back, the draft left, probed in the background and handed
    the running requests, the coordinator's health, its drain. The step loop reports what its calls raised
    (`lose_target_on`, `lose_draft_on`) and asks between steps (`leave_draft_if_asked`, `probe_draft`,
    `hand_over_draft`, `take_target_back`); the workers' health streams and the lease heartbeat (`Liveness`) reach
    it directly. It tells the step loop through `wake`: a target lost, a draft to try at once."""

    def __init__(
        self,
        target: WorkerLink,
        draft: WorkerLink,
        pair: Pair,
        health: Health,
        wake: asyncio.Event,
        retry_interval: float = 5.0,
        open_requests: Callable[[], int] = lambda: 0,
    ) -> None:
        """`health`: the coordinator's; `retry_interval`: seconds between
        tries of a lost worker; `open_requests`: how many requests the coordinator has open, for the log."""
        self.target, self.draft, self.pair = target, draft, pair
        self.health = health
        self.wake = wake
        self.retry_interval = retry_interval
        self._open_requests = open_requests
        self.draining = False  # the coordinator drains (`drain`)
        self._leave_reason: str | None = None  # why the draft is to be left at the next step (`leave_draft`)
        self._draft_short_of_room = False  # the draft was left for want of room once (`lose_draft_on`)
        self._draft_probe: asyncio.Task[bool] | None = None
        self._next_probe = 0.0  # (time.monotonic)
        self._draft_backlog: list[int] = []  # what a lost draft may still hold: released when it is back
        # The surviving side's end of the channel, to be closed once (`_close_end`) after its peer is lost.
        self._close_target_end = False
        self._close_draft_end = False
        self.liveness = Liveness(target, draft, pair, retry_interval, self)  # health streams, lease heartbeat
        self._reports: set[asyncio.Future[None]] = set()  # health reports in flight (`_lose_target`)

    # ----------------------------------------------------------------------------------------------- state

    @property
    def target_lost(self) -> bool:
        return self.target.state is LinkState.LOST

    @property
    def draft_connected(self) -> bool:
        """Whether steps draft: a draft service is configured and in use."""
        return self.draft.connected

    @property
    def draft_backlog(self) -> tuple[int, ...]:
        return tuple(self._draft_backlog)

    def refusal(self) -> Refusal | None:
        """Why a new request is refused now, or None: it is admitted."""
        return refusal_of(self.draining, self.target, self.retry_interval)

    # ----------------------------------------------------------------------------------------------- health

    async def target_said(self, stopping: bool) -> None:
        """The target's health said `stopping` (NOT_SERVING: a SIGTERM alone, as when its pod is replaced; it serves
        its calls on until none has come for a while, or its drain timeout): admit nothing new, so that what was
        admitted finishes on it and it can stop; once its stream ends it is lost, and the step loop takes the new
        one back. Admitting on would keep it busy until its drain timeout cut every request off."""
        if not self.target.connected or stopping == self.target.stopping:
            return
        self.target.stopping = stopping
        if stopping:
            log.warning(
                "the target service is shutting down: admitting nothing new until it is back; "
                "%d requests to finish on it",
                self._open_requests(),
            )
            await self._report_health(serving=False)

    async def draft_said(self, stopping: bool) -> None:
        """The draft's health said `stopping`: stop drafting at once (the target decodes alone), so that the draft
        goes quiet and stops long before its drain timeout, and take no draft back through this address while it
        says so (the old process still answers there); drafting on would keep a draft replaced alone busy until its
        drain timeout, then lose it in the middle of a call. While the coordinator drains too (a whole release
        deleted), the stopping draft drafts on for what is left: it serves as long as calls come."""
        was_stopping, self.draft.stopping = self.draft.stopping, stopping
        if self._refusing_stopping_draft and not was_stopping:
            self.leave_draft("the draft service is shutting down")

    @property
    def _refusing_stopping_draft(self) -> bool:
        """Whether the draft says it is stopping and is neither used nor taken back through its address (the old
        process still answers there); while the coordinator drains too, it drafts on."""
        return self.draft.stopping and not self.draining

    async def _report_health(self, serving: bool) -> None:
        """The coordinator's health: NOT_SERVING while the target cannot take requests, so that a load balancer
        sends them elsewhere."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, status)

    async def drain(self) -> None:
        """The coordinator drains: health NOT_SERVING for good and nothing new admitted (`refusal`); a draft that
        began stopping drafts on for what is left, tried at once (it may still answer, and drafts finish the drain
        sooner)."""
        self.draining = True
        await self.health.drain()
        if self.draft.stopping:
            self._next_probe = 0.0
            self.wake.set()

    def stop(self) -> None:
        """The coordinator stops: follow no worker's health, renew no lease, try no lost draft any more."""
        self.liveness.stop()
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
        why = lost_reason(exc)
        if why is None:
            return False
        self._drop_draft(f"draft service lost ({why})", held)
        return True

    def leave_draft(self, reason: str) -> None:
        """Leave the draft at the next step (`before_step`), not in the middle of one that has decided to
        call it (it would find no draft to call)."""
        self._leave_reason = reason

    def before_step(self, held: Iterable[int], drafts_waiting: bool = False) -> bool:
        """The step loop's one question before a step (`held`: what the batches hold; `drafts_waiting`: whether
        drafts wait for their verify): leave the draft if `leave_draft` asked to since the last step, try a lost
        draft when due (`probe_draft`); whether the draft is back, to be handed the running requests
        (`hand_over_draft`) once no drafts wait for their verify."""
        if self._leave_reason is not None:
            self._drop_draft(self._leave_reason, held)
            self._leave_reason = None
        return self.probe_draft(drafts_waiting)

    def _drop_draft(self, reason: str, held: Iterable[int], level: int = logging.ERROR) -> None:
        """Decode with the target alone from now on (`reason` says why, in the log at `level`) until the draft is
        back (`probe_draft`); drafts already made are still verified."""
        if self.draft.connected:
            log.log(level, "%s: continuing with the target alone", reason)
            self.draft.state = LinkState.LOST
            self._close_target_end = True
            # Only what was admitted by now can be on the draft (at most its slots), whatever ends meanwhile.
            self._draft_backlog = [*held, *self.draft.take_unreleased()]

    def probe_draft(self, drafts_waiting: bool = False) -> bool:
        """Between steps, while the draft is lost: try it in the background when a try is due (every retry interval),
        so that a hung draft, or one capturing its CUDA graphs at the connect, never stalls the steps; whether a
        try found it back, ready for `hand_over_draft`. None starts while drafts wait for their verify
        (`drafts_waiting`): a try closes the target's end of the channel and sets a fresh one up, and those drafts
        are on the old one (a cuda-ipc slot, an nccl send)."""
        probe, draft = self._draft_probe, self.draft
        if draft.state is LinkState.PROBING and probe is not None and probe.done():
            self._draft_probe = None
            back = not probe.cancelled() and probe.exception() is None and probe.result()
            draft.state = LinkState.HANDING_OVER if back else LinkState.LOST  # (tried again when due)
            return back
        if draft.state is LinkState.LOST and not drafts_waiting and time.monotonic() >= self._next_probe:
            self._next_probe = time.monotonic() + self.retry_interval
            self._draft_probe = asyncio.create_task(self._draft_answers())
            draft.state = LinkState.PROBING
        return draft.state is LinkState.HANDING_OVER

    async def _draft_answers(self) -> bool:
        """A probe: whether the draft answers a GetInfo within 2 s and then takes the channel set-up, which can be
        long (a restarted draft on a GPU captures its CUDA graphs then: 20-30 s for a 1B draft)."""
        if self._close_target_end:  # (the lost draft's buffers, which the target maps, freed even if it never returns)
            self._close_target_end = False
            await self._close_end("target")
        if self._refusing_stopping_draft:
            return False
        try:
            await self.pair.set_up_draft_again()
            self.reset_ledgers()
        except (grpc.RpcError, ModelLoadError, ValueError) as exc:
            log.info("draft service not back yet: %s", call_detail(exc))
            return False
        await self.draft.reopen_stream()
        return True

    async def hand_over_draft(
        self, running: Sequence[RequestState], prefill: Callable[[Sequence[RequestState]], Awaitable[None]]
    ) -> None:
        """Once `probe_draft` found the draft back, between steps with no drafts in flight: release what it may
        still hold, hand it every running request (`prefill`: with its output so far) and draft again."""
        draft = self.draft
        assert draft.stub is not None and draft.state is LinkState.HANDING_OVER
        if self._refusing_stopping_draft:  # it began stopping after the probe: a later probe takes the next one
            draft.state = LinkState.LOST
            return
        try:
            # A draft that was only unreachable still holds what was admitted before it was lost.
            stale = sorted(set(self._draft_backlog) | {r.seq_id for r in running})
            await draft.stub.Release(draft_pb2.DraftServiceReleaseRequest(seq_ids=stale), timeout=draft.timeout)
            if running:
                await prefill(running)
        except grpc.RpcError as exc:
            log.info("draft service not back yet: %s", call_detail(exc))
            draft.state = LinkState.LOST
            return
        self._draft_backlog = []
        draft.state = LinkState.CONNECTED
        log.warning("draft service back: speculative decoding again (%d running requests handed over)", len(running))

    # ----------------------------------------------------------------------------------------------- the target

    def lose_target_on(self, exc: BaseException) -> bool:
        """Whether `exc`, from a target call, means the target is unreachable, hung, restarted or its lease lost
        (`lost_reason`); if so it is lost."""
        why = lost_reason(exc)
        if why is None:
            return False
        self.lose_target(why)
        return True

    def lose_target(self, reason: str) -> None:
        """The target has lost every sequence it held: the step loop fails every open request (UNAVAILABLE: their
        clients may send them again), and nothing is admitted until `take_target_back` finds it back."""
        if not self.target_lost:
            log.error("target service lost (%s): failing every request until it is back", reason)
            self.target.state = LinkState.LOST
            self._close_draft_end = self.draft_connected
            self.wake.set()  # an idle loop reconnects at once
            # NOT_SERVING before the failed requests' clients hear of it: a load balancer moves on at once.
            report = asyncio.ensure_future(self._report_health(serving=False))
            self._reports.add(report)
            report.add_done_callback(self._reports.discard)

    async def _close_end(self, worker: str) -> None:
        """Close the surviving `worker`'s end of the channel (its peer is lost): best effort, as a worker older than
        the close may refuse it; a set-up later replaces it anyway."""
        try:
            await self.pair.close_channel(worker)
        except grpc.RpcError as exc:
            log.info("the %s's end of the channel not closed: %s", worker, call_detail(exc))

    async def report_target_lost(self) -> None:
        """Health NOT_SERVING while the target is lost."""
        await self._report_health(serving=False)

    async def take_target_back(self) -> bool:
        """While the target is lost (the step loop's, every retry interval): whether it answers a GetInfo within 2 s,
        serves a model the draft still pairs with, and takes the channel set-up again; if so it serves (health
        follows with `report_target_back`)."""
        if self._close_draft_end:  # at the first try, with no step running: what the draft maps of the lost target
            self._close_draft_end = False
            await self._close_end("draft")
        try:
            await self.pair.set_up_target_again(with_draft=self.draft_connected)
            self.reset_ledgers()
        except (grpc.RpcError, ModelLoadError, ValueError) as exc:
            log.info("target service not back yet: %s", call_detail(exc))
            return False
        await self.target.reopen_stream()
        if self.draft_connected:
            await self.draft.reopen_stream()
        self.target.state, self.target.stopping = LinkState.CONNECTED, False
        return True

    async def target_back(self, stopping: Callable[[], bool]) -> bool:
        """Try the lost target every retry interval, or at once when woken, until it is back (True) or `stopping`
        says the coordinator stops (False)."""
        while not stopping():
            if await self.take_target_back():
                return True
            self.wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), self.retry_interval)
        return False

    async def report_target_back(self) -> None:
        """Once the target is back and what the lost one held is released: health SERVING."""
        log.warning("target service back: serving again")
        await self._report_health(serving=True)

    def reset_ledgers(self) -> None:
        """What the workers reported of their KV blocks at the pair's set-up (again after a loss)."""
        for link, info in ((self.target, self.pair.target_info), (self.draft, self.pair.draft_info)):
            link.ledger.reset(info.block_size, info.num_blocks, info.free_blocks, info.prefix_caching)
