"""What unauthenticated or idle traffic may cost a coordinator, through real processes: memory, file descriptors,
log lines.

One coordinator, in front of the session's tiny Llama workers, wants an API key on both public ports; each port
holds at most CAP connections, a new one must send its request's headers (gRPC: finish its handshake) within
HEADER_S and a connection may idle IDLE_S. Once started, its open-files limit is lowered to what it holds plus
both ports' caps and a margin: a port that took connections beyond its cap would starve the other of descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import re
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry
from stack import MAX_MODEL_LEN, SERVICE_ENV, Service, Workers, coordinator_args, server_port, spawn, stop_all, wait_all

from coordinator.connection_gate import ConnectionGate, GatedListener
from coordinator.http_api import bind_http, listen
from minedraft.observability.metrics import start_metrics_server
from minedraft.proto import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from minedraft.rpc.lease import LEASE_METADATA, SECRET_METADATA
from minedraft.rpc.limits import ConnectionLimits
from minedraft.rpc.server_utils import start_server

pytest_plugins = ["stack"]

API_KEY = "limits-test-key"
BEARER = [("authorization", f"Bearer {API_KEY}")]
CAP, HEADER_S, IDLE_S = 64, 2.0, 3.0
K = 4


@dataclass
class Limited:
    service: Service
    http_port: int
    model: str

    @property
    def log_bytes(self) -> int:
        return os.path.getsize(self.service.log_path)


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Limited]:
    http_port = server_port()
    extra = ["--http-port", str(http_port), "--max-connections", str(CAP)]
    extra += ["--header-timeout", str(HEADER_S), "--idle-timeout", str(IDLE_S)]
    env = {**SERVICE_ENV, "MINEDRAFT_API_KEY": API_KEY}
    args = coordinator_args(llama_workers, "psd", k=K, extra=extra)
    service = spawn("coordinator-limits", args, stack_logs, env=env)
    try:
        wait_all([service])
        held = len(os.listdir(f"/proc/{service.proc.pid}/fd"))
        fds = held + 2 * (CAP + CAP // 8) + 64
        resource.prlimit(service.proc.pid, resource.RLIMIT_NOFILE, (fds, fds))
        yield Limited(service, http_port, str(llama_workers.pair.target))
    finally:
        stop_all([service])


# --------------------------------------------------------------------------------------------- helpers


def _flood_size() -> int:
    """Idle sockets a test opens: 2,000, or what this process's own open-files limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return min(2000, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 300)


def _connect_many(port: int, count: int) -> list[socket.socket]:
    """`count` connections that never send a byte (connected without waiting: the server accepts them)."""
    socks = []
    for _ in range(count):
        sock = socket.socket()
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
    return socks


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b"" or _closed(sock)
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _wait_closed(socks: list[socket.socket], timeout: float) -> float:
    """Seconds until every socket of `socks` was closed by the server; fails after `timeout`."""
    start, left = time.monotonic(), list(socks)
    while left:
        left = [s for s in left if not _closed(s)]
        assert time.monotonic() - start < timeout, f"{len(left)} of {len(socks)} sockets still open"
        time.sleep(0.05)
    for sock in socks:
        sock.close()
    return time.monotonic() - start


async def _generate(address: str, channel: grpc.aio.Channel | None = None) -> tuple[int, float]:
    """One 8-token Generate with the token: its tokens and seconds."""
    start = time.monotonic()
    params = generation_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt_token_ids=[5, 17, 42, 99], params=params)
    async with contextlib.nullcontext(channel) if channel else grpc.aio.insecure_channel(address) as used:
        stub = generation_pb2_grpc.GenerationServiceStub(used)
        tokens = [t async for m in stub.Generate(request, timeout=30, metadata=BEARER) for t in m.token_ids]
    return len(tokens), time.monotonic() - start


def _http(port: int, method: str, path: str, body: Any = None, token: bool = True) -> tuple[int, Any, float]:
    """One HTTP request on a connection of its own: status, JSON body, seconds."""
    start = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {API_KEY}"} if token else {})}
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read()), time.monotonic() - start
    finally:
        conn.close()


def _complete(limited: Limited) -> tuple[int, float]:
    status, body, took = _http(limited.http_port, "POST", "/v1/completions", _completion(limited.model))
    assert status == 200, body
    return body["usage"]["completion_tokens"], took


def _completion(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": [5, 17, 42, 99], "max_tokens": 8, "ignore_eos": True}


# --------------------------------------------------------------------------------------------- idle sockets


def test_idle_sockets_on_the_http_port_are_shut_while_both_apis_serve(coordinator: Limited) -> None:
    """Idle sockets far beyond the cap, and a few that send their headers a byte at a time: the HTTP port shuts the
    oldest waiting ones for newer ones and refuses the rest at once, so a real request still gets in; the gRPC
    port, with descriptors of its own, serves as usual; every idle socket is closed within the header timeout (a
    kept-alive connection within the idle timeout), and the log gets a line a second at most."""
    log_before = coordinator.log_bytes
    idle = _connect_many(coordinator.http_port, _flood_size())
    time.sleep(0.2)
    slow = _connect_many(coordinator.http_port, 4)  # (newer than the idle ones: not shut for them)
    start = time.monotonic()
    assert asyncio.run(_generate(coordinator.service.address))[0] == 8
    tokens, took = _complete(coordinator)
    assert tokens == 8 and took < 5
    for _ in range(int(HEADER_S / 0.25) + 4):  # a byte of a request every 0.25 s: never whole in time
        for sock in slow:
            with contextlib.suppress(OSError):
                sock.send(b"P")
        time.sleep(0.25)
    _wait_closed(idle + slow, HEADER_S + 1.5 - (time.monotonic() - start))
    kept = http.client.HTTPConnection("127.0.0.1", coordinator.http_port, timeout=30)
    kept.request("GET", "/health")
    assert kept.getresponse().read() and kept.sock is not None
    assert _wait_closed([kept.sock], IDLE_S + 1.5) > IDLE_S - 0.5  # kept alive that long, not longer
    assert coordinator.log_bytes - log_before < 2000, coordinator.service.log_tail(4000)


def test_idle_sockets_on_the_grpc_port_are_shut_while_both_apis_serve(coordinator: Limited) -> None:
    """The same against the gRPC port: grpc core refuses the sockets beyond the cap at once and closes the rest at
    the handshake timeout; a channel connected before serves on, the HTTP port serves as usual, and new gRPC
    connections get in again once the idle ones are gone. (grpc core shuts no idle connection for a new one: until
    the header timeout, a new gRPC connection is refused.)"""
    log_before = coordinator.log_bytes

    async def during_the_flood() -> tuple[int, float]:
        async with grpc.aio.insecure_channel(coordinator.service.address) as channel:
            await _generate(coordinator.service.address, channel)  # connected
            idle.extend(_connect_many(coordinator.service.port, _flood_size()))
            await asyncio.sleep(0.5)
            return await _generate(coordinator.service.address, channel)

    idle: list[socket.socket] = []
    tokens, took = asyncio.run(during_the_flood())
    assert tokens == 8 and took < 5
    start = time.monotonic()
    tokens, took = _complete(coordinator)
    assert tokens == 8 and took < 5
    _wait_closed(idle, HEADER_S + 2.5 - (time.monotonic() - start))
    assert asyncio.run(_generate(coordinator.service.address))[0] == 8
    assert coordinator.log_bytes - log_before < 2000, coordinator.service.log_tail(4000)


def test_running_out_of_descriptors_costs_a_log_line_a_second(caplog: pytest.LogCaptureFixture) -> None:
    """asyncio logs a traceback per failed accept, up to its backlog per turn of the loop (115 MB in 23 s, seen):
    through a `GatedListener` it is one line a second with a count."""
    clients: list[socket.socket] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    async def main() -> None:
        gate = ConnectionGate(ConnectionLimits(1000, 30, 30))
        listener = GatedListener.of(listen("127.0.0.1", 0), gate)
        clients.extend(_connect_many(listener.getsockname()[1], 90))
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, sock=listener)
        gate.quiet_accept_errors(listener)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 10, hard))
        try:
            await asyncio.sleep(2.5)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert 0 < gate.open < 90, gate.open  # (some accepted before the descriptors ran out)
        server.close()

    with caplog.at_level(logging.WARNING):
        try:
            asyncio.run(main())
        finally:
            for sock in clients:
                sock.close()
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(lines) <= 4 and all("out of descriptors" in r.getMessage() for r in lines), lines


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


# --------------------------------------------------------------------------------------------- memory


def test_distinct_unauthenticated_method_names_keep_nothing(coordinator: Limited) -> None:
    """Each made-up method name, refused, was once kept for good (a handler cache per name): 10,000 names of 2 KB
    grew the coordinator by some 20 MB. Scaled down from 40,000 short names (the growth follows the names' bytes)
    to keep the test short."""
    pid, address = coordinator.service.proc.pid, coordinator.service.address
    assert asyncio.run(_unknown_methods(address, 0, 1000, 2048)) == {grpc.StatusCode.UNIMPLEMENTED}
    start = _rss_mb(pid)  # (after the allocator's arenas have grown for such calls)
    assert asyncio.run(_unknown_methods(address, 1000, 10_000, 2048)) == {grpc.StatusCode.UNIMPLEMENTED}
    assert _rss_mb(pid) - start < 10, (start, _rss_mb(pid))


# --------------------------------------------------------------------------------------------- the lease


def test_a_replayed_owner_and_epoch_without_the_secret_change_nothing(
    coordinator: Limited, llama_workers: Workers
) -> None:
    """While the coordinator streams requests, a process that reaches the target reads the owner from a refused
    call's error and sends it back with the lease's epoch, without the lease's secret or with a guess: the calls are
    refused, the lease is neither given up nor taken, no sequence is freed, and every request ends whole."""
    target = llama_workers.target
    lease_lines = target.log_tail(10**6).count("lease")
    params = generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    requests = [generation_pb2.GenerateRequest(prompt_token_ids=[5, 17, i], params=params) for i in range(4)]

    async def replay() -> list[str]:
        async with grpc.aio.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            info = (await stub.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=10)).info
            assert info.free_slots < info.num_slots  # the requests' sequences are held there meanwhile
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Release(target_pb2.TargetServiceReleaseRequest(seq_ids=[1]), timeout=10)
            said = [refused.value.details() or ""]
            owner = re.search(r"coordinator (\S+) holds this worker's lease", said[0])
            assert owner is not None, said
            taken = re.findall(rf"lease (\d+) taken by coordinator {re.escape(owner[1])}", target.log_tail(10**6))
            for epoch in (0, int(taken[-1])):  # (its real epoch, from the worker's log: the replay at its best)
                for secret in ([], [(SECRET_METADATA, "guessed")]):
                    metadata = [(LEASE_METADATA, f"{owner[1]} {epoch}"), *secret]
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Release(target_pb2.TargetServiceReleaseRequest(seq_ids=[1]), metadata=metadata)
                    said.append(refused.value.details() or "")
                    lease = target_pb2.TargetServiceLeaseRequest(owner=owner[1], epoch=epoch, give_up=True)
                    await stub.Lease(lease, timeout=10, metadata=metadata)  # (answered; nothing given up)
                    lease.give_up = False  # a renewal, or with epoch 0 a take under its name
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Lease(lease, timeout=10, metadata=metadata)
                    said.append(refused.value.details() or "")
        return said

    async def main() -> tuple[list[tuple[int, float]], list[str]]:
        async with grpc.aio.insecure_channel(coordinator.service.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)

            async def one(request: generation_pb2.GenerateRequest) -> tuple[int, float]:
                start = time.monotonic()
                messages = [m async for m in stub.Generate(request, timeout=60, metadata=BEARER)]
                return sum(len(m.token_ids) for m in messages), time.monotonic() - start

            load = asyncio.gather(*(one(r) for r in requests))
            await asyncio.sleep(0.5)  # admitted, decoding
            said = await replay()
            return await load, said

    done, said = asyncio.run(main())
    assert [tokens for tokens, _ in done] == [200] * 4
    assert all("epoch" not in s and "guessed" not in s for s in said), said
    assert target.log_tail(10**6).count("lease") == lease_lines, target.log_tail()
    assert "lease lost" not in coordinator.service.log_tail(10**6)


# --------------------------------------------------------------------------------------------- lesser


def test_health_with_a_slash_is_open_and_a_long_chunked_body_names_the_flag(coordinator: Limited) -> None:
    port = coordinator.http_port
    assert _http(port, "GET", "/health/", token=False)[:2] == (200, {"status": "serving"})
    assert _http(port, "GET", "/v1/models", token=False)[0] == 401
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:  # no Content-Length: chunks, 5 MiB in all (--max-request-bytes is 4 MiB)
        headers = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
        conn.request("POST", "/v1/completions", iter([b"x" * (1 << 20)] * 5), headers, encode_chunked=True)
        reply = conn.getresponse()
        status, error = reply.status, json.loads(reply.read())["error"]
    finally:
        conn.close()
    assert status == 400 and "--max-request-bytes" in error["message"], error


def test_server_info_reports_the_context_its_errors_name(coordinator: Limited) -> None:
    async def info_and_refusal() -> tuple[int, str]:
        async with grpc.aio.insecure_channel(coordinator.service.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            info = await stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10, metadata=BEARER)
            request = generation_pb2.GenerateRequest(prompt_token_ids=[5] * info.max_model_len)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect_all(stub.Generate(request, timeout=10, metadata=BEARER))
            return info.max_model_len, refused.value.details() or ""

    context, error = asyncio.run(info_and_refusal())
    assert context == MAX_MODEL_LEN - K and f"context is {context} tokens" in error, (context, error)


async def collect_all(call: Any) -> None:
    async for _ in call:
        pass


def test_a_port_in_use_is_named() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1 port {port} \\(--metrics-port"):
            start_metrics_server(port, "127.0.0.1", CollectorRegistry())
        with pytest.raises(OSError, match=f"127.0.0.1 port {port} \\(--port\\)"):
            asyncio.run(start_server(port, [], [], "127.0.0.1"))
        with pytest.raises(OSError, match=f"port {port} \\(--http-port"):
            bind_http("127.0.0.1", port)


def test_a_port_another_grpc_server_holds_is_refused() -> None:
    """gRPC binds with SO_REUSEPORT by default, which let a second server start on a port one already held: the
    kernel then handed each new connection to either (seen as a coordinator losing its "target" when a stranger on
    its port stopped, two test stacks on one host). A held port now fails the start, naming it."""

    async def two_servers() -> None:
        first, port = await start_server(0, [], [], "127.0.0.1")
        try:
            with pytest.raises(OSError, match=f"127.0.0.1 port {port} \\(--port\\)"):
                second, _ = await start_server(port, [], [], "127.0.0.1")
                await second.stop(None)
        finally:
            await first.stop(None)

    asyncio.run(two_servers())


def test_a_taken_http_port_fails_the_start_before_any_model_loads(tmp_path: Path) -> None:
    """The coordinator binds --http-port before it dials its workers (none listen here), and `minedraft serve`
    checks it before it starts a worker: each exits at once, naming the port and the flag."""
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        dead = f"127.0.0.1:{server_port()}"
        common = ["--host", "127.0.0.1", "--http-port", str(port), "--port", "0"]
        for command in (
            ["coordinator", "--target", dead, "--draft", dead],
            ["serve", "--target", str(tmp_path / "no-model"), "--draft", str(tmp_path / "no-model")],
        ):
            start = time.monotonic()
            run = subprocess.run(
                [sys.executable, "-m", "minedraft_app", *command, *common],
                env=SERVICE_ENV,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode == 1 and f"port {port} (--http-port" in run.stderr, run.stderr
            assert "Traceback" not in run.stderr and time.monotonic() - start < 30, run.stderr
