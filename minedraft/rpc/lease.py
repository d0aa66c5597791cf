"""Worker leases: the one coordinator whose internal calls a worker serves, until it gives up or stops renewing."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from minedraft.errors import LeaseError, LeaseSecretError
from minedraft.proto import common_pb2

log = logging.getLogger(__name__)

LEASE_METADATA = "minedraft-lease"  # "<owner> <epoch>" on every call to a worker
SECRET_METADATA = "minedraft-lease-secret"  # the lease's secret, beside it: never logged, never in an error


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def deployment_secret(value: str | None) -> str | None:
    """The --lease-secret given (None: none, or empty); ValueError where gRPC metadata could not carry it intact."""
    if not value:
        return None
    if not (value.isascii() and value.isprintable()) or value != value.strip():
        raise ValueError("--lease-secret (MINEDRAFT_LEASE_SECRET): printable ASCII without spaces around it")
    return value


@dataclass
class Ticket:
    """The lease a coordinator holds on one worker, as its calls present it (epoch 0: none yet), with the secret it
    made for it: random per coordinator process, or the deployment's (MINEDRAFT_LEASE_SECRET)."""

    owner: str
    epoch: int = 0
    ttl_s: float = 0.0  # 0: a worker without leases (older than them), renewed by nothing
    secret: str = field(default_factory=new_secret, repr=False)

    def metadata(self) -> list[tuple[str, str]]:
        return [(LEASE_METADATA, f"{self.owner} {self.epoch}"), (SECRET_METADATA, self.secret)]


class Presented(NamedTuple):
    """The lease a call presents: owner and epoch, and the secret ("" from a coordinator older than secrets)."""

    owner: str
    epoch: int
    secret: str = ""


def presented(context: grpc.aio.ServicerContext) -> Presented | None:
    """The lease a call's metadata presents, or None."""
    ticket, secret = None, ""
    for key, value in context.invocation_metadata() or ():
        if key == LEASE_METADATA and isinstance(value, str):
            owner, _, epoch = value.rpartition(" ")
            if owner and epoch.isdigit():
                ticket = (owner, int(epoch))
        elif key == SECRET_METADATA and isinstance(value, str):
            secret = value
    return Presented(*ticket, secret) if ticket is not None else None


def same_secret(given: str, secret: str) -> bool:
    """In constant time: a wrong secret's length or prefix tells the caller nothing."""
    return hmac.compare_digest(given.encode(), secret.encode())


class Leases:
    """A worker's side: who holds it, since when it was last renewed, and what happens when the holder goes.

    `free_all` frees every sequence the worker holds; it runs before a new owner is served, after the lease of an
    owner that died (no renewal for `ttl_s`) or gave up. A lease is served to the calls that present its owner,
    epoch and the secret its taker made; with `deployment_secret` (MINEDRAFT_LEASE_SECRET) only a taker presenting
    that one gets a lease at all."""

    def __init__(
        self,
        ttl_s: float,
        free_all: Callable[[], Awaitable[int]],
        clock: Callable[[], float] = time.monotonic,
        deployment_secret: str | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self._free_all = free_all
        self._clock = clock
        self._deployment_secret = deployment_secret
        self.owner: str | None = None
        self.epoch = 0
        self._secret = ""  # the current lease's
        self._renewed = 0.0
        self._calls = 0  # internal calls running under the current lease
        self._lock = asyncio.Lock()

    @property
    def live(self) -> bool:
        """Held: renewed within `ttl_s`, or a call under it still running (a Prepare can outlast the lease)."""
        return self.owner is not None and (self._calls > 0 or self._clock() - self._renewed < self.ttl_s)

    def _holder(self) -> str:
        """Who holds the lease, for an operator (the lease's epoch and secret are no one else's business)."""
        left = self.ttl_s - (self._clock() - self._renewed)
        return f"coordinator {self.owner} holds this worker's lease ({left:.1f} s left unrenewed)"

    def _presents(self, owner: str, epoch: int, secret: str) -> bool:
        """Whether a call presents the current lease, secret and all (compared first, whatever the rest)."""
        return same_secret(secret, self._secret) and (owner, epoch) == (self.owner, self.epoch)

    def check(self, ticket: Presented | None) -> None:
        """An internal call: served only under the current lease, which it renews; else LeaseError."""
        if ticket is None:
            raise LeaseError(
                "internal call without a lease: only the coordinator holding this worker's lease may make it"
                + (f"; {self._holder()}" if self.live else " (take one with the Lease call)")
            )
        if not (self.live and self._presents(*ticket)):
            raise LeaseError(
                "the lease this call presents is not this worker's current one"
                + (f": {self._holder()}" if self.live else ": it expired and what it held was freed")
            )
        self._renewed = self._clock()

    @contextlib.contextmanager
    def held(self, ticket: Presented | None) -> Iterator[None]:
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

    async def take(self, owner: str, epoch: int, give_up: bool, secret: str = "") -> common_pb2.Lease:
        """The Lease call, presenting `secret`: renew `owner`'s lease of `epoch`, give it up, or (epoch 0) grant a
        new one unless another's is live (the same owner's, taken again, only with its secret); what an earlier
        lease held is freed before the new one is granted."""
        if self._deployment_secret is not None and not same_secret(secret, self._deployment_secret):
            raise LeaseSecretError(
                "this worker leases only to a coordinator with the deployment's lease secret (MINEDRAFT_LEASE_SECRET "
                "or --lease-secret, the same on the coordinator and its workers): this one's is missing or differs"
            )
        async with self._lock:
            if give_up:
                if self.owner is not None and self._presents(owner, epoch, secret):
                    await self._end("given up")
                return common_pb2.Lease()
            if epoch and self.live and self._presents(owner, epoch, secret):
                self._renewed = self._clock()
            elif self.live and not (owner == self.owner and same_secret(secret, self._secret)):
                raise LeaseError(f"{self._holder()}: a second coordinator is refused until that lease expires")
            elif epoch:
                raise LeaseError("this lease is not this worker's current one: take a new one (epoch 0)")
            else:
                if self.owner is not None:
                    await self._end("taken again by its owner" if owner == self.owner else "expired")
                self.owner, self.epoch, self._renewed, self._calls = owner, self.epoch + 1, self._clock(), 0
                self._secret = secret
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
    for key, value in ticket.metadata():
        metadata.add(key, value)
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
