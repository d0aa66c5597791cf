"""The workers' liveness as the coordinator follows it: their health streams and the leases' heartbeat."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc

from coordinator.health_watch import follow_health
from coordinator.pairing import Pair
from coordinator.worker_link import WorkerLink

UNANSWERED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


class LivenessEvents(Protocol):
    """What liveness tells (`Failover`)."""

    async def target_said(self, stopping: bool) -> None: ...

    async def draft_said(self, stopping: bool) -> None: ...

    def lose_target(self, reason: str) -> None: ...

    def leave_draft(self, reason: str) -> None: ...


class Liveness:
    """Tasks that run until `stop`: each worker's health stream (`follow_health`) and the heartbeat of both
    leases; what they find goes to `events`, the one writer of the links' state."""

    def __init__(
        self, target: WorkerLink, draft: WorkerLink, pair: Pair, retry_interval: float, events: LivenessEvents
    ) -> None:
        self.target, self.draft, self.pair = target, draft, pair
        self.retry_interval = retry_interval
        self.events = events
        self._tasks: list[asyncio.Task[None]] = []

    def keep_leases(self) -> None:
        """Renew both workers' leases from now until `stop`: once they are taken, before the workers' start-up
        work (a Prepare can outlast a lease)."""
        self._tasks.append(asyncio.create_task(self._renew_leases()))

    def watch_health(self) -> None:
        """Follow both workers' health until `stop`: a target whose stream breaks while it said SERVING is lost."""
        assert self.target.channel is not None
        self._watch(self.target.channel, "target", self.events.target_said, self.events.lose_target)
        if self.draft.channel is not None:
            self._watch(self.draft.channel, "draft", self.events.draft_said)

    def _watch(
        self,
        channel: grpc.aio.Channel,
        name: str,
        said: Callable[[bool], Awaitable[None]],
        gone: Callable[[str], None] | None = None,
    ) -> None:
        self._tasks.append(asyncio.create_task(follow_health(channel, name, self.retry_interval, said, gone)))

    async def _renew_leases(self) -> None:
        """The leases' heartbeat, three times a lease's life: a lease another coordinator took meanwhile (this one
        was paused past it) loses that worker; an unanswered one is left to the health streams and the calls."""
        unanswered = 0  # the target's renewals in a row that failed for want of an answer
        while True:
            tickets = self.pair.tickets
            ttl = min((t.ttl_s for t in tickets.values() if t.epoch), default=0.0)
            await asyncio.sleep(ttl / 3 if ttl else self.retry_interval)
            for link in (self.target, self.draft):
                failed = await self._renew(link)
                if link is self.target:
                    unanswered = unanswered + 1 if failed is not None and failed.code() in UNANSWERED else 0
                    # Two in a row: an idle coordinator's only calls (a stopped target that the reconnect of its
                    # health stream hangs on); its lease runs out a heartbeat later anyway.
                    if unanswered >= 2 and failed is not None:
                        self.events.lose_target(f"two lease heartbeats unanswered ({failed.code().name})")
                if failed is None or failed.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    continue
                if link is self.target:
                    self.events.lose_target(f"its lease lost: {failed.details()}")
                else:
                    self.events.leave_draft(f"the draft's lease lost: {failed.details()}")

    async def _renew(self, link: WorkerLink) -> grpc.aio.AioRpcError | None:
        """Renew `link`'s lease, where it holds one and is in use; the error of a renewal that failed."""
        ticket = self.pair.tickets[link.name]
        if not ticket.epoch or not link.connected:
            return None
        try:
            await self.pair.renew_lease(link.name, timeout=max(ticket.ttl_s / 3, 0.5))
        except grpc.aio.AioRpcError as exc:
            return exc
        return None

    def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
