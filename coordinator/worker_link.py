"""One worker as the coordinator holds it: its connection, step stream, KV ledger, deadline, releases and state."""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

import grpc

from coordinator.call_deadlines import CallDeadline
from coordinator.kv_blocks import BlockLedger
from minedraft.rpc.step_stream import StepStream

log = logging.getLogger(__name__)

# A step call later than this many times its median is hung (`CallDeadline`), but never sooner than the floor: a
# late proposal costs the step only the floor (the target goes on alone), a late verify the whole target.
LATE_FACTOR = 20.0
DRAFT_LATE_FLOOR_S = 1.0
TARGET_LATE_FLOOR_S = 10.0


class LinkState(enum.Enum):
    """A worker as the coordinator sees it."""

    ABSENT = "absent"  # not configured (the draft in ar)
    CONNECTED = "connected"  # in use
    LOST = "lost"  # unreachable, hung or restarted: what it held is gone; tried again every retry interval
    PROBING = "probing"  # (the draft) being tried again in the background: GetInfo, then the channel set-up
    HANDING_OVER = "handing over"  # (the draft) answered a probe: takes the running requests between steps


class Reply(Protocol):
    """What every worker call answers: the worker's free KV blocks after it."""

    free_blocks: int


R = TypeVar("R", bound=Reply)


class WorkerLink:
    """The target or the draft service, held once each (`Workers`): the connection and stub, the step stream,
    what its KV blocks are believed to be (`ledger`), its step calls' deadline, the sequences to release with its
    next call, its state (`LinkState`) and whether its health says it is stopping. `call` is the one way a call
    goes to it; the state changes only through `Failover`, which decides on what calls and health report."""

    def __init__(
        self,
        name: str,
        channel: grpc.aio.Channel | None,
        stub: Any,
        stream: StepStream | None,
        timeout: float | None,
        late_floor: float,
        call_made: Callable[[], None] = lambda: None,
    ) -> None:
        """`name`: "target" or "draft", in logs and metrics; `channel` and `stub`: None where it is absent;
        `timeout`: a call that outlives it loses the worker (None: no deadline); `call_made`: told as each call
        is sent (`Workers`: the step loop's outbox may flush)."""
        self.name, self.channel, self.stub, self.stream = name, channel, stub, stream
        self.timeout = timeout
        self.deadline = CallDeadline(LATE_FACTOR, late_floor, timeout)
        self.ledger = BlockLedger()
        self.state = LinkState.CONNECTED if stub is not None else LinkState.ABSENT
        self.stopping = False  # its health says NOT_SERVING
        self.calls_in_flight = 0
        self._call_made = call_made
        self._unreleased: list[int] = []

    @property
    def connected(self) -> bool:
        return self.state is LinkState.CONNECTED

    def release_later(self, seq_ids: list[int]) -> None:
        """Free `seq_ids` with the next call to this worker (a round trip saved per step that finishes one)."""
        self._unreleased += seq_ids

    def take_unreleased(self) -> list[int]:
        """What no call has released yet, no longer to be sent (a lost draft's backlog)."""
        taken, self._unreleased = self._unreleased, []
        return taken

    @property
    def has_unreleased(self) -> bool:
        return bool(self._unreleased)

    async def call(self, send: Callable[[list[int]], Awaitable[R]], blocks: int = 0) -> R:
        """A call made with `send(released)` (the releases it carries), that may take `blocks` KV blocks: the
        ledger counts them until the reply reports the worker's free blocks; the releases are put back if it
        fails (releasing is idempotent)."""
        released, self._unreleased = self._unreleased, []
        self.ledger.sent(blocks)
        free: int | None = None
        self.calls_in_flight += 1
        try:
            call = send(released)
            self._call_made()
            reply = await call
            free = reply.free_blocks if self.ledger.accounted else None
            return reply
        except BaseException:
            self._unreleased = released + self._unreleased
            raise
        finally:
            self.calls_in_flight -= 1
            self.ledger.answered(blocks, free)

    def step_call(
        self, unary: Callable[..., Awaitable[R]], request: object, trace_context: dict[str, str]
    ) -> Awaitable[R]:
        """A Verify or Propose call, sent now with its measured deadline: on the worker's step stream, or unary
        where there is none (asked for, or a worker that has none: it answers the first message UNIMPLEMENTED
        and gets this call again)."""
        timeout, stream = self.deadline.timeout(), self.stream
        if stream is None or stream.unimplemented:
            return unary(request, timeout=timeout)
        reply = stream.call(request, timeout, trace_context)

        async def or_unary() -> R:
            try:
                return cast(R, await reply)
            except grpc.aio.AioRpcError:
                if not stream.unimplemented:
                    raise
                log.warning("a worker has no step streams (an older version): unary step calls to it from now on")
                return await unary(request, timeout=timeout)

        return or_unary()

    async def reopen_stream(self) -> None:
        """After a new lease: the next step call opens a new stream, which presents it (a stream presents the lease
        it was opened under)."""
        if self.stream is not None:
            await self.stream.close()

    async def close(self) -> None:
        await self.reopen_stream()
        if self.channel is not None:
            await self.channel.close()
