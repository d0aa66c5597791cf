"""What unauthenticated or idle traffic may cost a coordinator, through real processes: memory, file descriptors,
log lines.

One coordinator, in front of the session's tiny Llama workers, wants an API key on both public ports.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from stack import SERVICE_ENV, Service, Workers, coordinator_args, spawn, stop_all, wait_all

from minedraft_app.stack import free_port

pytest_plugins = ["stack"]

API_KEY = "limits-test-key"


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Service]:
    extra = ["--http-port", str(free_port())]
    env = {**SERVICE_ENV, "MINEDRAFT_API_KEY": API_KEY}
    service = spawn("coordinator-limits", coordinator_args(llama_workers, "psd", extra=extra), stack_logs, env=env)
    wait_all([service])
    yield service
    stop_all([service])


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


async def _unknown_methods(address: str, first: int, count: int, name_bytes: int) -> set[grpc.StatusCode]:
    """`count` calls without a token, each to a method of its own that no server has; the codes they got."""
    async with grpc.aio.insecure_channel(address) as channel:
        room = asyncio.Semaphore(64)

        async def one(i: int) -> grpc.StatusCode:
            async with room:
                call: Any = channel.unary_unary(f"/made.up{i}.Service/{'M' * name_bytes}{i}")
                try:
                    await call(b"", timeout=30)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

        return set(await asyncio.gather(*(one(i) for i in range(first, first + count))))


def test_distinct_unauthenticated_method_names_keep_nothing(coordinator: Service) -> None:
    """Each made-up method name, refused, was once kept for good (a handler cache per name): 10,000 names of 2 KB
    grew the coordinator by some 20 MB. Scaled down from 40,000 short names (the growth follows the names' bytes)
    to keep the test short."""
    pid = coordinator.proc.pid
    assert asyncio.run(_unknown_methods(coordinator.address, 0, 1000, 2048)) == {grpc.StatusCode.UNIMPLEMENTED}
    start = _rss_mb(pid)  # (after the allocator's arenas have grown for such calls)
    assert asyncio.run(_unknown_methods(coordinator.address, 1000, 10_000, 2048)) == {grpc.StatusCode.UNIMPLEMENTED}
    assert _rss_mb(pid) - start < 10, (start, _rss_mb(pid))
    assert os.path.getsize(coordinator.log_path) < 100_000
