"""The HTTP port's connections counted where they are accepted: a cap, and a deadline for each request's headers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
import time
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from minedraft.rpc.limits import ConnectionLimits, LogEvery

log = logging.getLogger(__name__)

# What asyncio's accept loop says once per call when the process is out of descriptors (counted here instead).
OUT_OF_RESOURCE = "socket.accept() out of system resource"
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_REFUSALS_PER_CALL = 64  # then the event loop gets a turn; the rest wait in the backlog
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends a reset and nothing lingers


class ConnectionGate:
    """The connections of one listening socket, TLS handshakes included: at most `limits.max_connections` open
    (beyond, the one that has waited longest for its request's headers is shut to make room, or, when all are busy
    with requests, the new one is refused at once); one that has not sent a request's headers within
    `limits.header_timeout` of its start (`limits.idle_timeout` of its last response) is shut."""

    def __init__(self, limits: ConnectionLimits, name: str = "HTTP port") -> None:
        self.limits, self.name = limits, name
        self._open: dict[int, socket.socket] = {}  # by descriptor
        self._waiting: dict[int, float] = {}  # descriptor -> deadline of its request's headers, oldest first
        self._log = LogEvery(log)
        self._rest_until = 0.0  # after running out of descriptors, accept nothing until then

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, conn: socket.socket) -> bool:
        """Whether a connection just accepted may stay (it then waits for its request's headers)."""
        cap = self.limits.max_connections
        if len(self._open) >= cap:
            # Shut connections close at the event loop's next turn: a few more than the cap meanwhile, no more.
            if not self._waiting or len(self._open) >= cap + max(cap // 8, 1):
                self._log.count(f"{self.name}: connections refused at --max-connections {cap}")
                return False
            self._shut(next(iter(self._waiting)), f"{self.name}: idle connections shut for newer ones")
        self._open[conn.fileno()] = conn
        self.waiting(conn.fileno(), self.limits.header_timeout)
        return True

    def waiting(self, fd: int, timeout: float) -> None:
        """The connection `fd` waits for a request's headers, `timeout` seconds at most."""
        if fd in self._open:
            self._waiting.pop(fd, None)
            self._waiting[fd] = time.monotonic() + timeout

    def reading(self, fd: int) -> None:
        """The connection `fd` sent a request's headers: no deadline while it is served."""
        self._waiting.pop(fd, None)

    def closed(self, fd: int) -> None:
        self._open.pop(fd, None)
        self._waiting.pop(fd, None)

    def out_of_descriptors(self) -> bool:
        """Count an accept that failed for want of descriptors; whether to stay quiet (asyncio would try again at
        once, and log each try, up to its backlog per turn)."""
        now = time.monotonic()
        self._log.count(f"{self.name}: accept failed, the process is out of descriptors (ulimit -n)")
        quiet, self._rest_until = now < self._rest_until, max(self._rest_until, now + 0.5)
        return quiet

    def resting(self) -> bool:
        return time.monotonic() < self._rest_until

    def _shut(self, fd: int, why: str) -> None:
        """Shut the connection down: its transport reads the end and closes it at the loop's next turn."""
        self._waiting.pop(fd, None)
        with contextlib.suppress(OSError):
            self._open[fd].shutdown(socket.SHUT_RDWR)
        self._log.count(why)

    async def run(self, interval: float = 0.25) -> None:
        """Until cancelled: shut the connections past their deadline, and log the counts."""
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for fd in [fd for fd, deadline in self._waiting.items() if deadline <= now]:
                self._shut(
                    fd, f"{self.name}: connections shut that sent no request in time (--header-timeout, --idle-timeout)"
                )
            self._log.flush()

    def quiet_accept_errors(self, listener: socket.socket) -> None:
        """Keep asyncio from logging a traceback per failed accept of `listener` (`out_of_descriptors` counts
        them); other exceptions of the loop go where they went."""
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        fd = listener.fileno()

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            sock = context.get("socket")
            if context.get("message") == OUT_OF_RESOURCE and sock is not None and sock.fileno() == fd:
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handler)


class _Connection(socket.socket):
    """An accepted connection that tells its gate when it closes."""

    gate: ConnectionGate | None = None

    def close(self) -> None:
        gate, self.gate = self.gate, None
        if gate is not None:
            gate.closed(self.fileno())
        super().close()


class GatedListener(socket.socket):
    """A listening socket whose accept (asyncio's, for each connection) goes through `gate`: a connection refused
    there is reset at once and never reaches the event loop."""

    gate: ConnectionGate

    @classmethod
    def of(cls, sock: socket.socket, gate: ConnectionGate) -> GatedListener:
        """`sock`, bound and listening, now accepting through `gate` (`sock` is detached)."""
        listener = cls(sock.family, sock.type, sock.proto, fileno=sock.detach())
        listener.gate = gate
        return listener

    def accept(self) -> tuple[socket.socket, Any]:
        if self.gate.resting():
            raise BlockingIOError(errno.EAGAIN, "resting after running out of descriptors")
        for _ in range(_REFUSALS_PER_CALL):
            try:
                fd, address = self._accept()  # type: ignore[attr-defined]
            except OSError as exc:
                if exc.errno in _RESOURCE_ERRORS and self.gate.out_of_descriptors():
                    raise BlockingIOError(errno.EAGAIN, "resting after running out of descriptors") from exc
                raise
            conn = _Connection(self.family, self.type, self.proto, fileno=fd)
            if self.gate.admit(conn):
                conn.gate = self.gate
                return conn, address
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            conn.close()
        raise BlockingIOError(errno.EAGAIN, "more refused at the next turn")


class GatedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol telling its gate when a connection has a request's headers, and when it waits
    for the next one. A subclass per gate (`gated_protocol`): uvicorn makes the protocol from its config alone."""

    gate: ConnectionGate
    _fd = -1

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._fd = transport.get_extra_info("socket").fileno()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self.gate.reading(self._fd)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.gate.waiting(self._fd, self.gate.limits.idle_timeout)


def gated_protocol(gate: ConnectionGate) -> type[GatedH11]:
    return type("GatedH11", (GatedH11,), {"gate": gate})
