"""Tensor-parallel ranks of a worker: rank 0 serves and hands every engine call to the others, which repeat it.

Rank 0 is the gRPC service; ranks 1..N-1 are processes it starts, each holding its shard of the model
(`minedraft.engine.tensor_parallel`). Before running an engine call (the target's verifier, the draft's proposer:
prefill, the step with what it needs, release, warm-up, precapture) rank 0 writes it to each rank's pipe; every rank
runs the identical call, so the forwards' all-reduces meet. The sampling runs on every rank, identically: every rank
computes the same logits (the LM head is whole, an all-reduce leaves the same sum everywhere) and the samplers'
uniforms are a pure function of (seed, position), so each rank makes the same tokens and keeps the same sequence
state without a second collective to hand results back. Only rank 0 talks to the coordinator and the data plane.

The calls go over a pipe rather than a broadcast in the group: a rank idle between requests then waits on its pipe
for as long as it likes, where a collective would time out, and it sees rank 0 go (end of file) at once.
A rank that exits, or a call that fails midway on rank 0, makes rank 0 report NOT_SERVING and answer UNAVAILABLE,
then exit, so that whatever supervises the service starts the whole group anew (a NCCL or gloo group takes no new
member, and ranks out of step cannot be trusted). A hung rank counts as one that exited, within seconds rather than
after the collective timeout: each rank reports on a pipe of its own back to rank 0, from a thread, the number of
calls it has finished and the all-reduces it has begun, every HEARTBEAT_S and after each call (`Liveness` says when
silence or lag means hung).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from minedraft.engine.tensor_parallel import Progress, TensorParallel, init_group, rank_device
from minedraft.errors import CapacityError, ModelLoadError, RankLostError, UnknownSequenceError
from minedraft.rpc.options import WorkerOptions
from minedraft.rpc.worker import ModelWorker

log = logging.getLogger(__name__)
# What a rank runs its calls with, made from its loaded worker (the verifier, the proposer): a call's name and
# arguments in, run to the end (results read as rank 0's reply reads them); made by a module-level function (or a
# partial of one) that rank 0 hands to the rank's process.
RunCall = Callable[[str, Sequence[object]], None]
MakeEngine = Callable[[ModelWorker], RunCall]

# A collective that waits longer than this for a rank fails (a hung rank); one that died is seen by the watcher.
COLLECTIVE_TIMEOUT_S = 60.0
# After a rank died: how long rank 0 reports NOT_SERVING and answers UNAVAILABLE before it exits.
EXIT_AFTER_S = 2.0
# After a call failed on rank 0: how long the watcher may take to name a rank that died (then the call's error is why).
NAMED_WITHIN_S = 1.0
# How often each rank reports, and how long a silence (or a lag behind rank 0, beyond rank 0's own time) means hung.
HEARTBEAT_S = 0.25
HANG_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Liveness:
    """Rank 0's view of whether ranks 1..N-1 still run: each one's last report (calls it has finished, all-reduces it
    has begun), the calls rank 0 finished. A rank is hung once it has been silent for HANG_S (stopped: its reporting
    thread stopped too), or once it is more than HANG_S plus twice rank 0's own time behind rank 0: in finishing a
    call (the call's last collective has met, what is left is the same work rank 0 did), or in reaching the
    all-reduce rank 0 waits in (since the one before, which they left together, or the call's start, rank 0 did the
    same work). A rank loading its shard is not watched: the clock starts at its first report, or at rank 0's first
    call (a rank then has nothing long left)."""

    def __init__(self, ranks: int) -> None:
        self.heard: list[float | None] = [None] * ranks  # (time.monotonic) of each rank's last report
        self.done = [0] * ranks  # calls each rank has finished
        self.entered = [0] * ranks  # all-reduces each rank has begun (`Progress`: counted on gloo)
        self.sent = 0  # calls rank 0 handed on
        self._due: deque[tuple[int, float]] = deque()  # (call, when every rank must have finished it)
        self._lock = threading.Lock()

    def report(self, rank: int, done: int, entered: int, now: float) -> None:
        """Rank `rank` (1..N-1) says it has finished `done` calls and begun `entered` all-reduces."""
        with self._lock:
            self.heard[rank - 1], self.done[rank - 1], self.entered[rank - 1] = now, done, entered

    def send(self, now: float) -> int:
        """Rank 0 hands on a call: its number (from 1)."""
        with self._lock:
            self.heard = [now if h is None else h for h in self.heard]
            self.sent += 1
            return self.sent

    def finished(self, call: int, took: float, now: float) -> None:
        """Rank 0 finished `call`, which took it `took` seconds."""
        with self._lock:
            self._due.append((call, now + HANG_S + 2 * took))

    def hung(self, now: float, waiting: Progress | None = None) -> tuple[int, str] | None:
        """A rank that is hung and why, or None; `waiting`: rank 0's own progress in the all-reduces."""
        with self._lock:
            for rank, heard in enumerate(self.heard, 1):
                if heard is not None and now - heard > HANG_S:
                    return rank, f"has not reported for {now - heard:.1f} s (stopped, or hung)"
            while self._due and min(self.done) >= self._due[0][0]:
                self._due.popleft()
            if self._due and now > self._due[0][1]:
                call = self._due[0][0]
                rank = next(r for r, d in enumerate(self.done, 1) if d < call)
                return rank, f"has not finished call {call} long after rank 0 did (stuck)"
            since = waiting.waiting_since if waiting is not None else None
            if waiting is not None and since is not None and now - since > HANG_S + 2 * (since - waiting.synced):
                behind = [r for r, e in enumerate(self.entered, 1) if e < waiting.entered]
                if behind:
                    late = now - since
                    return behind[0], f"has not reached all-reduce {waiting.entered} {late:.1f} s after rank 0 (stuck)"
            return None


class RankGroup:
    """Rank 0's side of the group: the other ranks' processes and the pipes their calls go down, watched by a thread
    that turns the service (`service`: its name, in what the coordinator is told) unavailable as soon as one of them
    exits or hangs."""

    def __init__(self, options: WorkerOptions, make_engine: MakeEngine, service: str) -> None:
        size = options.tensor_parallel_size
        self.service = service
        address = f"127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")  # (CUDA cannot be forked)
        self.pipes: list[Connection] = []
        self.reports: list[Connection] = []  # (each rank's `Liveness` reports)
        self.processes: list[BaseProcess] = []
        self.liveness = Liveness(size - 1)
        self.lost: str | None = None
        self._lost = threading.Event()
        self._failing = threading.Lock()
        self._closing = False
        self.on_lost: list[Callable[[], object]] = []  # what the service does then (its health NOT_SERVING)
        for rank in range(1, size):
            reader, writer = context.Pipe(duplex=False)
            report_reader, report_writer = context.Pipe(duplex=False)
            process = context.Process(
                target=follow,
                args=(options, rank, address, reader, report_writer, make_engine),
                name=f"tp-rank-{rank}",
            )
            process.start()
            reader.close()
            report_writer.close()
            self.pipes.append(writer)
            self.reports.append(report_reader)
            self.processes.append(process)
            log.info("tensor-parallel rank %d of %d started as pid %d", rank, size, process.pid)
        atexit.register(self.close)  # (before multiprocessing's own exit handler, which would wait for the ranks)
        # Watching before the rendezvous: a rank that fails to start must not leave rank 0 waiting for it.
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        device = torch.device(rank_device(options.device, 0))
        self.tp: TensorParallel = init_group(0, size, address, device, COLLECTIVE_TIMEOUT_S, options.deterministic)

    def send(self, name: str, args: Sequence[object], prefix_caching: bool) -> int:
        """Hand the call `name(*args)` to every other rank (tensors among `args` on the host), to run with prefix
        caching as on rank 0 (whose warm-up prefills turn it off); the call's number, for `finished`."""
        if self.lost is not None:
            raise RankLostError(self.lost)
        message = pickle.dumps((name, args, prefix_caching))
        call = self.liveness.send(time.monotonic())
        try:
            for pipe in self.pipes:
                pipe.send_bytes(message)
        except OSError as exc:
            raise RankLostError(self.wait_lost()) from exc
        return call

    def finished(self, call: int, took: float) -> None:
        """Rank 0 has run `call` in `took` seconds: every other rank must finish it soon after."""
        self.liveness.finished(call, took, time.monotonic())

    def wait_lost(self, timeout: float = 2.0) -> str:
        """Why the group is lost, once the watcher knows (a failed collective can come first)."""
        self._lost.wait(timeout)
        return self.lost or f"a tensor-parallel rank stopped answering: the {self.service} is unavailable"

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.processes}
        by_report = {c: rank for rank, c in enumerate(self.reports, 1)}
        while not self._closing:
            for ready in wait([*by_sentinel, *by_report], timeout=HEARTBEAT_S):
                if ready in by_report:
                    try:
                        while ready.poll():  # type: ignore[union-attr]  # (every report waiting: the latest counts)
                            done, entered = struct.unpack("<qq", ready.recv_bytes())  # type: ignore[union-attr]
                            self.liveness.report(by_report[ready], done, entered, time.monotonic())
                    except (EOFError, OSError):
                        del by_report[ready]  # (it exits: its sentinel says so)
                elif not self._closing:
                    process = by_sentinel[ready]  # type: ignore[index]
                    process.join(timeout=1)  # (reaped: its exit code known)
                    self.fail(f"tensor-parallel {process.name} (pid {process.pid}) exited with code {process.exitcode}")
                    return
            tp: TensorParallel | None = getattr(self, "tp", None)  # (None: rank 0 is still joining the group)
            hung = self.liveness.hung(time.monotonic(), tp.progress if tp is not None else None)
            if hung is not None and not self._closing:
                process = self.processes[hung[0] - 1]
                self.fail(f"tensor-parallel {process.name} (pid {process.pid}) {hung[1]}")
                return

    def fail(self, why: str) -> None:
        """The group is lost (`why`): NOT_SERVING and UNAVAILABLE from now on, the other ranks stopped, and rank 0
        exits shortly, for its supervisor to start the group anew."""
        with self._failing:
            if self.lost is not None:
                return
            self.lost = f"{why}: the {self.service} is unavailable until it is started again"
        log.error("%s; exiting in %.0f s", self.lost, EXIT_AFTER_S)
        self._lost.set()
        for callback in self.on_lost:
            callback()
        self.close(kill=True)  # (a hung rank reads no end of file; a collective waiting on it then fails at once)
        threading.Timer(EXIT_AFTER_S, _exit).start()

    def close(self, kill: bool = False) -> None:
        """Stop the other ranks (rank 0 is stopping); `kill`: at once, rather than when they read their pipe's end."""
        self._closing = True
        for pipe in self.pipes:
            pipe.close()  # (a rank reads the end of its pipe and exits)
        for process in self.processes:
            if kill and process.is_alive():
                process.kill()
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


def _exit() -> None:
    logging.shutdown()
    os._exit(1)


def _on_host(args: Sequence[object]) -> tuple[object, ...]:
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


class Mirrored:
    """Rank 0's engine (verifier or proposer): each call handed to the other ranks first, then run here; a service
    wraps its engine's calls in `call`."""

    def __init__(self, engine: Any, ranks: RankGroup) -> None:
        self.engine = engine
        self.ranks = ranks

    def call(self, name: str, *args: object) -> Any:
        pool = self.engine.runner.cache.pool
        call = self.ranks.send(name, _on_host(args), pool is not None and pool.prefix_caching)
        start = self.ranks.tp.progress.synced = time.monotonic()  # (the ranks start the call together)
        try:
            result = getattr(self.engine, name)(*args)
            self.ranks.finished(call, time.monotonic() - start)
            return result
        except (CapacityError, UnknownSequenceError, ValueError):
            self.ranks.finished(call, time.monotonic() - start)
            raise  # (raised alike on every rank, before any collective: the ranks stay in step)
        except Exception as exc:
            # A rank gone, a collective timed out, or anything else midway: the ranks may be out of step. A killed
            # rank's sockets close before it can be reaped, so the collective can fail first: the watcher, which
            # names the rank, gets a moment.
            self.ranks.wait_lost(NAMED_WITHIN_S)
            self.ranks.fail(f"{name} failed on rank 0 ({exc})")  # (nothing, where the watcher failed the group)
            raise RankLostError(self.ranks.wait_lost()) from exc

    def held_seq_ids(self) -> list[int]:
        held: list[int] = self.engine.held_seq_ids()  # (every rank holds the same)
        return held

    def release(self, seq_ids: Sequence[int]) -> None:
        self.call("release", list(seq_ids))

    def precapture(self, k: int, max_batch: int) -> int:
        shapes: int = self.call("precapture", k, max_batch)
        return shapes


def _die_with_parent() -> None:
    """This process is killed when the one that started it (rank 0) dies, however it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Reporter:
    """A rank's side of `Liveness`: the calls it has finished and the all-reduces it has begun, sent to rank 0 after
    each call and every HEARTBEAT_S from a thread of its own (which a stopped process stops too)."""

    def __init__(self, pipe: Connection, progress: Progress) -> None:
        self.pipe = pipe
        self.progress = progress
        self.done = 0
        self._lock = threading.Lock()  # (two threads write the pipe)
        threading.Thread(target=self._beat, name="tp-report", daemon=True).start()

    def finished(self) -> None:
        self.done += 1
        self._send()

    def _send(self) -> None:
        with self._lock, contextlib.suppress(OSError):  # (rank 0 is gone: the calls' pipe says so)
            self.pipe.send_bytes(struct.pack("<qq", self.done, self.progress.entered))

    def _beat(self) -> None:
        while True:
            self._send()
            time.sleep(HEARTBEAT_S)


def follow(
    options: WorkerOptions, rank: int, address: str, calls: Connection, reports: Connection, make_engine: MakeEngine
) -> None:
    """A rank other than 0: its shard loaded, then every engine call rank 0 hands on, in order, until rank 0 is
    gone; what it has done reported on `reports`."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    device = torch.device(rank_device(options.device, rank))
    tp = init_group(rank, options.tensor_parallel_size, address, device, COLLECTIVE_TIMEOUT_S, options.deterministic)
    try:
        worker = ModelWorker(options, tp)
    except ModelLoadError as exc:  # rank 0 meets the same, and says it
        log.error("rank %d cannot load its shard: %s", rank, exc)
        sys.exit(1)
    run_call = make_engine(worker)
    worker._on_device()  # (its stream current here, as on rank 0's compute thread)
    pool = worker.runner.cache.pool
    assert pool is not None
    reporter = Reporter(reports, tp.progress)
    while True:
        try:
            name, args, pool.prefix_caching = pickle.loads(calls.recv_bytes())
        except EOFError:
            log.info("rank 0 is gone: rank %d stops", rank)
            logging.shutdown()
            os._exit(0)  # not through the interpreter's teardown: gloo's threads then may abort the process
        try:
            run_call(name, args)
        except Exception as exc:  # rank 0 raised the same, and its caller got it
            log.warning("%s failed, as on rank 0: %s", name, exc)
        reporter.finished()
