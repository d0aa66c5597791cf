"""Service processes forked from one that has already imported torch and transformers, so that a start costs a fork.

Each service would otherwise spend 3-5 s of a CPU importing them (most of a tiny worker's CPU time in a stack test,
and dozens of services start in a suite run). Run as a script, this module is that process (the launcher): it
imports them, then forks a child per request, which runs `python -m minedraft_app <args>` as a fresh process would
(its own session, output to its log, its environment), and reports each child's exit status. The tests' side
(`Launcher`, `ForkedProcess`) gives each child Popen's interface. A child forked by a single-threaded process that
has run no torch operation starts as clean as an exec'd one; gRPC is not imported before the fork.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import selectors
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

# Imported before any fork: the modules every service imports, and that take seconds.
PRELOADED = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto")
# Variables a child may set differently from the launcher's environment: none of the preloaded modules reads them.
CHILD_ONLY_PREFIXES = ("MINEDRAFT_", "OTEL_")


# ------------------------------------------------------------------------------------------ the launcher process


def _write(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _serve_requests() -> dict[str, Any]:
    """Fork a child per request read from stdin, reporting `started <pid>` and `exited <pid> <code>` on stdout;
    returns (in the child) its request. Stdin's end (the tests' process gone) kills the children left."""
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    if "grpc" in sys.modules:  # (its core must not be started before a fork)
        raise RuntimeError("a preloaded module imported grpc")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a Ctrl-C is the tests' process's to handle; stdin's end ends us)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (the wake-up fd is written only for a handled signal)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    live: set[int] = set()
    pending = b""
    _write("ready")
    while True:
        for key, _ in selector.select():
            if key.fd == wake_read:
                os.read(wake_read, 4096)
                while live:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    live.discard(pid)
                    _write(f"exited {pid} {os.waitstatus_to_exitcode(status)}")
                continue
            chunk = os.read(0, 65536)
            if not chunk:  # the tests' process is gone: so are its services
                for pid in live:
                    os.kill(pid, signal.SIGKILL)
                os._exit(0)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)  # (as in any Python process)
                    os.close(wake_read)
                    os.close(wake_write)
                    return dict(request)
                live.add(pid)
                _write(f"started {pid}")


def _become(request: dict[str, Any]) -> None:
    """In the forked child: become `python -m minedraft_app <args>` started in a new session, output to the log."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]  # (as `python -m` run there has it)
    sys.argv = ["minedraft_app", *request["args"]]
    runpy.run_module("minedraft_app", run_name="__main__", alter_sys=True)


# ------------------------------------------------------------------------------------------- the tests' side


class Launcher:
    """The launcher process, started by the tests' process on its first `spawn`; stopped (with every child left)
    when the tests' process exits."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.env, self.cwd = env, cwd
        self.proc = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=cwd
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._stdin: IO[bytes] = self.proc.stdin
        self._stdout: IO[bytes] = self.proc.stdout
        self._exits: dict[int, int] = {}
        self._started: list[int] = []
        self._changed = threading.Condition()
        self._spawning = threading.Lock()
        self._ready = threading.Event()
        threading.Thread(target=self._read, name="launcher-reader", daemon=True).start()

    def _read(self) -> None:
        for raw in self._stdout:
            word, *rest = raw.decode().split()
            with self._changed:
                if word == "ready":
                    self._ready.set()
                elif word == "started":
                    self._started.append(int(rest[0]))
                elif word == "exited":
                    self._exits[int(rest[0])] = int(rest[1])
                self._changed.notify_all()
        with self._changed:  # the launcher died: nothing it forked can be waited for any more
            self._ready.set()
            self._changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def can_start(self, env: dict[str, str]) -> bool:
        """Whether a child with environment `env` starts as it would from scratch (it differs from the launcher's
        only in variables that the preloaded modules do not read)."""
        keys = set(env) | set(self.env)
        return all(env.get(k) == self.env.get(k) or k.startswith(CHILD_ONLY_PREFIXES) for k in keys)

    def spawn(self, args: Sequence[str], log_path: str, env: dict[str, str]) -> ForkedProcess:
        if not self._ready.wait(120) or not self.alive():
            raise RuntimeError("the service launcher did not start")
        with self._spawning, self._changed:
            request = {"args": list(args), "log": log_path, "env": env, "cwd": self.cwd}
            self._stdin.write(json.dumps(request).encode() + b"\n")
            self._stdin.flush()
            if not self._changed.wait_for(lambda: self._started or not self.alive(), 60) or not self._started:
                raise RuntimeError("the service launcher forked nothing")
            pid = self._started.pop(0)
        return ForkedProcess(self, pid, ["minedraft_app", *args])

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code once it has exited, waiting up to `timeout` s (None: as long as it takes)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
            return self._exits.get(pid)

    def stop(self) -> None:
        self._stdin.close()  # (the launcher kills its children and exits)
        self.proc.wait(timeout=30)


class ForkedProcess(subprocess.Popen):
    """Popen's interface to a child of the launcher: its pid, signals, poll and wait with the exit code."""

    def __init__(self, launcher: Launcher, pid: int, args: list[str]) -> None:  # (not Popen's: nothing to start)
        self._child_created = False  # (Popen.__del__ reads it)
        self.launcher = launcher
        self.pid = pid
        self.args = self.command = args
        self.returncode: Any = None
        self.stdin = self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.launcher.exit_code(self.pid, timeout)
            if self.returncode is None:
                if not self.launcher.alive():
                    raise RuntimeError(f"the service launcher died before {' '.join(self.command)} exited")
                raise subprocess.TimeoutExpired(self.command, timeout or 0)
        return int(self.returncode)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    _become(_serve_requests())
