"""Starting and stopping the target, draft and coordinator processes of `serve` and `bench --modes`."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc

from minedraft.rpc.security import ClientTls, client_tls, sync_channel
from minedraft_app.flags import FLAGS, LOOPBACK, STACK_SERVICES, dest

METRICS_PORT_OFFSET = {"coordinator": 0, "target": 1, "draft": 2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def ports_taken(host: str, ports: dict[str, int]) -> str | None:
    """What says the first of `ports` (flag -> port, 0: none) that cannot be listened on at `host` ("[::]": every
    address) is taken; None if each can be."""
    address = host.strip("[]")
    every = address in ("", "::")
    family = socket.AF_INET6 if every or ":" in address else socket.AF_INET
    for name, port in ports.items():
        if not port:
            continue
        try:
            dual = every and socket.has_dualstack_ipv6()
            with socket.create_server((address or "::", port), family=family, dualstack_ipv6=dual):
                pass
        except OSError as exc:
            return f"cannot listen on {host} port {port} ({name}; another process may hold it): {exc}"
    return None


def _raise_if_one_exited(processes: Sequence[subprocess.Popen]) -> None:
    for proc in processes:
        if proc.poll() is not None:
            raise RuntimeError(f"a service exited with code {proc.returncode} during start-up")


def wait_healthy(
    address: str, processes: Sequence[subprocess.Popen], timeout: float = 300.0, tls: ClientTls | None = None
) -> None:
    """Block until `address` answers SERVING on grpc.health.v1 (over `tls` where given), or fail if a process
    died."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    # Short reconnect backoff: a service that takes 20 s to start must be seen within a poll, not a backoff later.
    options = [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
        ("grpc.min_reconnect_backoff_ms", 100),
    ]
    with sync_channel(address, tls, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            _raise_if_one_exited(processes)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not become healthy in {timeout:.0f} s")


def wait_port_file(path: Path, processes: Sequence[subprocess.Popen], timeout: float = 300.0) -> int:
    """The port a service started with `--port-file path` listens on, once it has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text())
        _raise_if_one_exited(processes)
        time.sleep(0.1)
    raise TimeoutError(f"no service wrote {path} in {timeout:.0f} s")


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT until the block is done, then deliver it (to the previous handler) if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)


def start_stack(
    args: argparse.Namespace, popen: Callable[[list[str]], subprocess.Popen], processes: list[subprocess.Popen]
) -> int:
    """Start the services of `stack_commands(args, ...)`, workers first, each on a port it binds itself (a port
    picked here and handed over could be taken in between); appends them to `processes` as they start and returns
    the coordinator's port once it serves (`args.port`, or the one it picked for 0)."""
    with tempfile.TemporaryDirectory(prefix="minedraft-ports-") as directory:

        def launch(command: list[str], name: str) -> Path:
            path = Path(directory) / name
            with _interrupts_deferred():  # a Ctrl-C inside Popen would leave its child running, untracked
                processes.append(popen([*command, "--port-file", str(path)]))
            return path

        # Both workers load their models at once.
        files = [launch(command, name) for command, name in zip(stack_commands(args, 0, 0)[:-1], ("target", "draft"))]
        worker_ports = [wait_port_file(path, processes) for path in files]
        for port in worker_ports:
            wait_healthy(f"{LOOPBACK}:{port}", processes, tls=stack_tls(args, worker=True))
        target_port, draft_port = worker_ports[0], worker_ports[-1] if len(worker_ports) > 1 else 0
        port = wait_port_file(launch(stack_commands(args, target_port, draft_port)[-1], "coordinator"), processes)
    wait_healthy(f"{LOOPBACK}:{port}", processes, tls=stack_tls(args, worker=False))
    return port


def stack_tls(args: argparse.Namespace, worker: bool) -> ClientTls | None:
    """How a stack's launcher checks its services: with serve's --tls-ca, over TLS, a worker with serve's
    certificate as the client's (mTLS); None: plaintext."""
    ca, cert, key = (getattr(args, name, None) for name in ("tls_ca", "tls_cert", "tls_key"))
    if not ca:
        return None
    server_name = getattr(args, "tls_server_name", None)
    if worker:
        return client_tls(ca, cert, key, server_name)
    return client_tls(ca, server_name=server_name) if cert else None


def check_stack_tls(args: argparse.Namespace) -> None:
    """serve's TLS flags make sense together: its certificate needs the CA that signed it, with which the services
    (and serve's own health checks) check each other; ValueError says what is missing."""
    cert, key, ca = (getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_ca"))
    if (cert or key or ca) and not (cert and key and ca):
        raise ValueError(
            "serve's TLS takes --tls-cert, --tls-key and --tls-ca together: the services serve that certificate "
            "and check each other's with that CA"
        )


# Of a GPU that target and draft share, the target's part of --gpu-memory-utilization: its weights and its KV
# per token are the larger (an 8B target caches 128 KiB a token, a 1B draft 32 KiB).
TARGET_SHARE = 0.8


def stack_commands(args: argparse.Namespace, target_port: int, draft_port: int) -> list[list[str]]:
    """The service command lines that `serve` starts: target, draft (left out in ar mode), coordinator."""
    services = [s for s in STACK_SERVICES if s != "draft" or args.mode != "ar"]
    wiring: dict[str, dict[str, object]] = {
        "target": {"--port": target_port, "--host": LOOPBACK},
        "draft": {"--port": draft_port, "--host": LOOPBACK},
        "coordinator": {"--target": f"{LOOPBACK}:{target_port}"},
    }
    if "draft" in services:
        wiring["coordinator"]["--draft"] = f"{LOOPBACK}:{draft_port}"
    metrics_port = getattr(args, "metrics_port", 0)
    if metrics_port:
        for service in services:
            wiring[service]["--metrics-port"] = metrics_port + METRICS_PORT_OFFSET[service]
    py = [sys.executable, "-m", "minedraft_app"]
    return [py + [service, *command_line(passed_on(args, service) | wiring[service])] for service in services]


def passed_on(args: argparse.Namespace, service: str) -> dict[str, object]:
    """The flags (by `service`'s names) that a stack of `serve`/`bench` arguments `args` gives `service`; a value
    that is None is left out, for the service to default. Target and draft on one GPU share its
    `--gpu-memory-utilization` (`TARGET_SHARE` of it the target's), unless `--kv-cache-memory` sizes their caches."""
    values: dict[str, object] = {}
    for flag in FLAGS:
        name = flag.passed_on.get(service)
        value = getattr(args, flag.dest, None)
        if name is not None and value is not None:
            values[name] = value
    if service in ("target", "draft") and "--tls-ca" not in values:  # a worker's TLS is mutual, or none
        values.pop("--tls-cert", None)
        values.pop("--tls-key", None)
    utilization = values.get("--gpu-memory-utilization")
    if service in ("target", "draft") and utilization is not None and shares_a_gpu(args):
        share = TARGET_SHARE if service == "target" else 1 - TARGET_SHARE
        values["--gpu-memory-utilization"] = round(float(utilization) * share, 4)  # type: ignore[arg-type]
    return values


def shares_a_gpu(args: argparse.Namespace) -> bool:
    """Whether a stack's draft loads on a GPU of the target's (their ranks' included), each sizing its KV cache by
    --gpu-memory-utilization."""
    from minedraft.engine.tensor_parallel import rank_device  # (torch: not for the stack's other users)

    target, draft = getattr(args, "target_device", None), getattr(args, "draft_device", None)
    if not (isinstance(target, str) and isinstance(draft, str) and target.startswith("cuda")):
        return False
    if "," in target + draft:
        return False  # (refused when the worker loads)

    def gpus(device: str, flag: str) -> set[str]:
        return {rank_device(device, rank) for rank in range(int(getattr(args, flag, 1) or 1))}

    return (
        getattr(args, "mode", None) != "ar"
        and getattr(args, "kv_cache_memory", None) is None
        and bool(gpus(draft, "draft_tensor_parallel_size") & gpus(target, "tensor_parallel_size"))
    )


def service_args(args: argparse.Namespace, service: str, **wiring: object) -> argparse.Namespace:
    """`service`'s arguments as its own parser would hold them, for a stack in one process."""
    return argparse.Namespace(**{dest(name): value for name, value in passed_on(args, service).items()}, **wiring)


def command_line(values: dict[str, object]) -> list[str]:
    """Flags and values as arguments: a switch that is on by its name alone, one that is off not at all."""
    line: list[str] = []
    for name, value in values.items():
        if value is True:
            line.append(name)
        elif isinstance(value, list | tuple):  # (a flag of several values)
            line += [name, *map(str, value)]
        elif value is not False:
            line += [name, str(value)]
    return line


def drain_process(proc: subprocess.Popen, drain_timeout: float) -> None:
    """SIGTERM a coordinator and wait while it drains (up to its `--drain-timeout`); a signal meanwhile ends the
    wait."""
    proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.wait(drain_timeout + 10)


def stop_processes(processes: Sequence[subprocess.Popen], timeout: float = 20.0) -> None:
    """SIGINT each (last started first: the coordinator stops sending work), then kill what outlives `timeout`.
    A second Ctrl-C meanwhile kills the rest at once: it must not leave a service running on its own."""
    try:
        for proc in reversed(processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
    except KeyboardInterrupt:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
        for proc in processes:
            proc.wait(timeout=10)
