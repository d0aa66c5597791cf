"""Connection limits of a listening port (a cap, a header timeout, an idle timeout) and the open-files limit."""

from __future__ import annotations

import functools
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)

# Descriptors kept for what is not a client connection: the workers' channels, model and log files, libraries.
FD_RESERVE = 512


@dataclass(frozen=True)
class ConnectionLimits:
    """What one listening port allows (--max-connections, --header-timeout, --idle-timeout)."""

    max_connections: int = 1024  # open at once; a connection beyond is refused at once
    header_timeout: float = 10.0  # seconds to send a request's headers (gRPC: to finish the handshake); 0: none
    idle_timeout: float = 60.0  # seconds a connection may go without a request or call; 0: none

    def check(self) -> None:
        """ValueError naming the flag of a limit that cannot work."""
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        for flag, value in (("--header-timeout", self.header_timeout), ("--idle-timeout", self.idle_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be above 0 seconds, got {value}")

    def grpc_options(self) -> list[tuple[str, int]]:
        """The grpc.aio server options that enforce them (grpc core closes the connections, refusing at accept)."""
        options = [("grpc.max_allowed_incoming_connections", self.max_connections)]
        if self.header_timeout:
            options.append(("grpc.server_handshake_timeout_ms", int(self.header_timeout * 1000)))
        if self.idle_timeout:
            options.append(("grpc.max_connection_idle_ms", int(self.idle_timeout * 1000)))
        return options


PUBLIC_LIMITS = ConnectionLimits()  # the coordinator's ports, by default
# A worker serves one coordinator, whose channel may go quiet between requests: no idle timeout there.
WORKER_LIMITS = ConnectionLimits(idle_timeout=0.0)


@functools.cache
def raise_fd_limit() -> int:
    """The soft limit on open files raised to the hard one, once per process (both logged); the soft one now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    was = soft
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # an unlimited hard limit that the kernel caps lower
            log.warning("open files: cannot raise the soft limit %d to the hard limit %d (%s)", soft, hard, exc)
    log.info("open files: soft limit %d (was %d), hard limit %d", soft, was, hard)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def fitted(limits: ConnectionLimits, ports: int) -> ConnectionLimits:
    """`limits` with a cap that `ports` ports can all reach at once within the open-files limit (raised first), so
    that a port flooded to its cap leaves the others their descriptors."""
    room = max((raise_fd_limit() - FD_RESERVE) // ports, 1)
    if limits.max_connections <= room:
        return limits
    log.warning(
        "--max-connections %d lowered to %d per port: %d ports must fit the open-files limit (ulimit -n)",
        limits.max_connections,
        room,
        ports,
    )
    return replace(limits, max_connections=room)


class LogEvery:
    """Counts of events logged at most once per `interval` seconds, one line with the counts since the last: a
    flood of refused connections costs a line a second, not a line each. Its messages are a fixed few (never one per
    peer)."""

    def __init__(
        self, logger: logging.Logger, interval: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.logger, self.interval, self.clock = logger, interval, clock
        self._counts: dict[str, int] = {}
        self._last = -interval

    def count(self, message: str) -> None:
        self._counts[message] = self._counts.get(message, 0) + 1
        self.flush()

    def flush(self) -> None:
        """Log the counts if the last line is `interval` old (the owner calls it now and then: no count waits)."""
        now = self.clock()
        if self._counts and now - self._last >= self.interval:
            self._last = now
            self.logger.warning("%s", "; ".join(f"{message}: {n}" for message, n in self._counts.items()))
            self._counts.clear()
