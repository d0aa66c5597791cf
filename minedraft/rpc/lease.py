"""Worker leases: the one coordinator whose internal calls a worker serves, until it gives up or stops renewing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from minedraft.errors import LeaseError
from minedraft.proto import common_pb2

log = logging.getLogger(__name__)

LEASE_METADATA = "minedraft-lease"  # "<owner> <epoch>" on every internal call


@dataclass
class Ticket:
    """The lease a coordinator holds on one worker, as its calls present it (epoch 0: none yet)."""

    owner: str
    epoch: int = 0
    ttl_s: float = 0.0  # 0: a worker without leases (older than them), renewed by nothing

    def metadata(self) -> tuple[str, str]:
        return LEASE_METADATA, f"{self.owner} {self.epoch}"


def presented(context: grpc.aio.ServicerContext) -> tuple[str, int] | None:
    """The (owner, epoch) a call's metadata presents, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == LEASE_METADATA and isinstance(value, str):
            owner, _, epoch = value.rpartition(" ")
            if owner and epoch.isdigit():
                return owner, int(epoch)
    return None


class Leases:
    """A worker's side: who holds it, since when it was last renewed, and what happens when the holder goes.

    `free_all` frees every sequence the worker holds; it runs before a new owner is served, after the lease of an
    owner that died (no renewal for `ttl_s`) or gave up."""

    def __init__(
        self, ttl_s: float, free_all: Callable[[], Awaitable[int]], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self._free_all = free_all
        self._clock = clock
        self.owner: str | None = None
        self.epoch = 0
        self._renewed = 0.0
        self._calls = 0  # internal calls running under the current lease
        self._lock = asyncio.Lock()

    @property
    def live(self) -> bool:
        """Held: renewed within `ttl_s`, or a call under it still running (a Prepare can outlast the lease)."""
        return self.owner is not None and (self._calls > 0 or self._clock() - self._renewed < self.ttl_s)

    def _holder(self) -> str:
        left = self.ttl_s - (self._clock() - self._renewed)
        return f"coordinator {self.owner} holds this worker's lease (epoch {self.epoch}, {left:.1f} s left unrenewed)"

    def check(self, ticket: tuple[str, int] | None) -> None:
        """An internal call: served only under the current lease, which it renews; else LeaseError."""
        if ticket is None:
            raise LeaseError(
                "internal call without a lease: only the coordinator holding this worker's lease may make it"
                + (f"; {self._holder()}" if self.live else " (take one with the Lease call)")
            )
        if not (self.live and ticket == (self.owner, self.epoch)):
            raise LeaseError(
                f"lease {ticket[0]} {ticket[1]} is not this worker's current one"
                + (f": {self._holder()}" if self.live else ": it expired and what it held was freed")
            )
        self._renewed = self._clock()

    @contextlib.contextmanager
    def held(self, ticket: tuple[str, int] | None) -> Iterator[None]:
        """Around an internal call: `check`ed, and the lease held until the call ends, then renewed."""
        self.check(ticket)
        epoch = self.epoch
        self._calls += 1
        try:
            yield
        finally:
            if self.epoch == epoch:  # (a lease taken anew meanwhile counts its own calls)
                self._calls -= 1
                self._renewed = self._clock()

    async def take(self, owner: str, epoch: int, give_up: bool) -> common_pb2.Lease:
        """The Lease call: renew `owner`'s lease of `epoch`, give it up, or (epoch 0) grant a new one unless
        another owner's is live; what an earlier lease held is freed before the new one is granted."""
        async with self._lock:
            if give_up:
                if self.owner == owner and epoch == self.epoch:
                    await self._end("given up")
                return common_pb2.Lease()
            if epoch and (owner, epoch) == (self.owner, self.epoch) and self.live:
                self._renewed = self._clock()
            elif self.live and owner != self.owner:
                raise LeaseError(f"{self._holder()}: a second coordinator is refused until that lease expires")
            elif epoch:
                raise LeaseError(f"lease {owner} {epoch} is not this worker's current one: take a new one (epoch 0)")
            else:
                if self.owner is not None:
                    await self._end("taken again by its owner" if owner == self.owner else "expired")
                self.owner, self.epoch, self._renewed, self._calls = owner, self.epoch + 1, self._clock(), 0
                log.info("lease %d taken by coordinator %s", self.epoch, owner)
            return common_pb2.Lease(owner=owner, epoch=self.epoch, ttl_s=self.ttl_s)

    async def _end(self, why: str) -> None:
        owner, self.owner = self.owner, None
        freed = await self._free_all()
        log.info("lease %d of coordinator %s %s: %d sequences it held freed", self.epoch, owner, why, freed)

    async def expire(self, poll_s: float | None = None) -> None:
        """Until cancelled: free what an owner that stopped renewing held, soon after its lease ran out."""
        while True:
            await asyncio.sleep(poll_s or max(self.ttl_s / 4, 0.05))
            if self.owner is not None and not self.live:
                async with self._lock:  # (a take meanwhile may have renewed it)
                    if self.owner is not None and not self.live:
                        await self._end("expired")


def _with_ticket(details: grpc.aio.ClientCallDetails, ticket: Ticket) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(*ticket.metadata())
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _TicketOnUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket

    async def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return await continuation(_with_ticket(details, self.ticket), request)


class _TicketOnStreams(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, ticket: Ticket) -> None:
        self.ticket = ticket

    async def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Any) -> Any:
        return await continuation(_with_ticket(details, self.ticket), requests)


def presenting(ticket: Ticket) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for a coordinator's channel to one worker: every call presents the lease `ticket` holds as the
    call starts (a channel takes one interceptor per kind of call)."""
    return [_TicketOnUnary(ticket), _TicketOnStreams(ticket)]
