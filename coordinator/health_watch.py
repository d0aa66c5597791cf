"""Following a worker's grpc.health.v1 status for as long as the coordinator runs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


async def follow_health(
    channel: grpc.aio.Channel,
    service: str,
    interval: float,
    changed: Callable[[bool], Awaitable[None]],
    gone: Callable[[str], None] | None = None,
) -> None:
    """Watch a worker's health until cancelled: `changed(stopping)` with each status it reports, `gone(why)` when its
    stream ends after it said it was stopping (it has stopped) or breaks while it said it was serving (killed,
    crashed, or its host gone); watch again (the next process on its address) every `interval` seconds. The second
    is what turns an idle coordinator NOT_SERVING for a killed target before any request's call fails."""
    health = health_pb2_grpc.HealthStub(channel)
    while True:
        said: bool | None = None  # whether this stream last said stopping (None: nothing, a failed connect)
        why = "it shut down"
        try:
            async for reply in health.Watch(health_pb2.HealthCheckRequest()):
                said = reply.status != health_pb2.HealthCheckResponse.SERVING
                await changed(said)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("the %s service has no health service: its shutdowns are not followed", service)
                return
            if said is False and exc.code() == grpc.StatusCode.UNAVAILABLE:
                said, why = True, f"its connection broke ({exc.details()})"
        if said and gone is not None:
            gone(why)
        await asyncio.sleep(interval)
