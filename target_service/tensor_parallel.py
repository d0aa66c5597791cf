"""Tensor-parallel ranks of the target: rank 0 serves and hands every verifier call to the others, which repeat it.

Rank 0 is the gRPC service; ranks 1..N-1 are processes it starts, each holding its shard of the model
(`minedraft.engine.tensor_parallel`). Before running a verifier call (prefill, verify with the drafts that came over
the data plane, release, warm-up, precapture) rank 0 writes it to each rank's pipe; every rank runs the identical
call, so the forwards' all-reduces meet. The rejection sampling runs on every rank, identically: every rank computes
the same logits (the LM head is whole, an all-reduce leaves the same sum everywhere) and the sampler's uniforms are a
pure function of (seed, position), so each rank commits the same tokens and keeps the same sequence state without a
second collective to hand results back.

The calls go over a pipe rather than a broadcast in the group: a rank idle between requests then waits on its pipe
for as long as it likes, where a collective would time out, and it sees rank 0 go (end of file) at once.
A rank that exits, or a call that fails midway on rank 0 (a collective timed out: a hung rank), makes rank 0 report
NOT_SERVING and answer UNAVAILABLE, then exit, so that whatever supervises the service starts the whole group anew
(a NCCL or gloo group takes no new member, and ranks out of step cannot be trusted).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from minedraft.engine.sampling import SamplingConfig
from minedraft.engine.tensor_parallel import TensorParallel, init_group, rank_device
from minedraft.errors import CapacityError, ModelLoadError, RankLostError, UnknownSequenceError
from minedraft.rpc.worker import ModelWorker, WorkerOptions
from target_service.verifier import StepResult, Verifier

log = logging.getLogger(__name__)

# A collective that waits longer than this for a rank fails (a hung rank); one that died is seen by the watcher.
COLLECTIVE_TIMEOUT_S = 60.0
# After a rank died: how long rank 0 reports NOT_SERVING and answers UNAVAILABLE before it exits.
EXIT_AFTER_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankGroup:
    """Rank 0's side of the group: the other ranks' processes and the pipes their calls go down, watched by a thread
    that turns the service unavailable as soon as one of them exits."""

    def __init__(self, options: WorkerOptions) -> None:
        size = options.tensor_parallel_size
        address = f"127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")  # (CUDA cannot be forked)
        self.pipes: list[Connection] = []
        self.processes: list[BaseProcess] = []
        self.lost: str | None = None
        self._lost = threading.Event()
        self._failing = threading.Lock()
        self._closing = False
        self.on_lost: list[Callable[[], object]] = []  # what the service does then (its health NOT_SERVING)
        for rank in range(1, size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=follow, args=(options, rank, address, reader), name=f"tp-rank-{rank}")
            process.start()
            reader.close()
            self.pipes.append(writer)
            self.processes.append(process)
            log.info("tensor-parallel rank %d of %d started as pid %d", rank, size, process.pid)
        atexit.register(self.close)  # (before multiprocessing's own exit handler, which would wait for the ranks)
        # Watching before the rendezvous: a rank that fails to start must not leave rank 0 waiting for it.
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        device = torch.device(rank_device(options.device, 0))
        self.tp: TensorParallel = init_group(0, size, address, device, COLLECTIVE_TIMEOUT_S)

    def send(self, name: str, args: Sequence[object], prefix_caching: bool) -> None:
        """Hand the call `name(*args)` to every other rank (tensors among `args` on the host), to run with prefix
        caching as on rank 0 (whose warm-up prefills turn it off)."""
        if self.lost is not None:
            raise RankLostError(self.lost)
        message = pickle.dumps((name, args, prefix_caching))
        try:
            for pipe in self.pipes:
                pipe.send_bytes(message)
        except OSError as exc:
            raise RankLostError(self.wait_lost()) from exc

    def wait_lost(self, timeout: float = 2.0) -> str:
        """Why the group is lost, once the watcher knows (a failed collective can come first)."""
        self._lost.wait(timeout)
        return self.lost or "a tensor-parallel rank stopped answering: the target is unavailable"

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.processes}
        ready = wait(list(by_sentinel))
        if self._closing:
            return
        process = by_sentinel[ready[0]]  # type: ignore[index]
        process.join(timeout=1)  # (reaped: its exit code known)
        self.fail(f"tensor-parallel {process.name} (pid {process.pid}) exited with code {process.exitcode}")

    def fail(self, why: str) -> None:
        """The group is lost (`why`): NOT_SERVING and UNAVAILABLE from now on, the other ranks stopped, and rank 0
        exits shortly, for its supervisor to start the group anew."""
        with self._failing:
            if self.lost is not None:
                return
            self.lost = f"{why}: the target is unavailable until it is started again"
        log.error("%s; exiting in %.0f s", self.lost, EXIT_AFTER_S)
        self._lost.set()
        for callback in self.on_lost:
            callback()
        self.close()
        threading.Timer(EXIT_AFTER_S, _exit).start()

    def close(self) -> None:
        """Stop the other ranks (rank 0 is stopping)."""
        self._closing = True
        for pipe in self.pipes:
            pipe.close()  # (a rank reads the end of its pipe and exits)
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


def _exit() -> None:
    logging.shutdown()
    os._exit(1)


def _on_host(args: Sequence[object]) -> tuple[object, ...]:
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


class MirroredVerifier:
    """The verifier of rank 0: each call handed to the other ranks first, then run here."""

    def __init__(self, verifier: Verifier, ranks: RankGroup) -> None:
        self.verifier = verifier
        self.ranks = ranks

    def _call(self, name: str, *args: object) -> Any:
        pool = self.verifier.runner.cache.pool
        self.ranks.send(name, _on_host(args), pool is not None and pool.prefix_caching)
        try:
            return getattr(self.verifier, name)(*args)
        except (CapacityError, UnknownSequenceError, ValueError):
            raise  # (raised alike on every rank, before any collective: the ranks stay in step)
        except Exception as exc:
            # A rank gone, a collective timed out, or anything else midway: the ranks may be out of step.
            if all(p.is_alive() for p in self.ranks.processes):
                self.ranks.fail(f"{name} failed on rank 0 ({exc})")
            raise RankLostError(self.ranks.wait_lost()) from exc

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> StepResult:
        result: StepResult = self._call("prefill", list(seq_ids), [list(p) for p in prompts], list(configs))
        return result

    def verify(
        self, seq_ids: Sequence[int], draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, batch_id: int | None
    ) -> StepResult:
        result: StepResult = self._call("verify", list(seq_ids), draft_ids, draft_probs, batch_id)
        return result

    def held_seq_ids(self) -> list[int]:
        return self.verifier.held_seq_ids()  # (every rank holds the same)

    def release(self, seq_ids: Sequence[int]) -> None:
        self._call("release", list(seq_ids))

    def precapture(self, k: int, max_batch: int) -> int:
        shapes: int = self._call("precapture", k, max_batch)
        return shapes

    def warm_up(self, k: int) -> None:
        self._call("warm_up", k)


def _die_with_parent() -> None:
    """This process is killed when the one that started it (rank 0) dies, however it dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def follow(options: WorkerOptions, rank: int, address: str, calls: Connection) -> None:
    """A rank other than 0: its shard loaded, then every verifier call rank 0 hands on, in order, until rank 0 is
    gone."""
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    device = torch.device(rank_device(options.device, rank))
    tp = init_group(rank, options.tensor_parallel_size, address, device, COLLECTIVE_TIMEOUT_S)
    try:
        worker = ModelWorker(options, tp)
    except ModelLoadError as exc:  # rank 0 meets the same, and says it
        log.error("rank %d cannot load its shard: %s", rank, exc)
        sys.exit(1)
    verifier = Verifier(worker.runner, worker.vocab.eos_token_ids, options.synthetic_acceptance)
    worker._on_device()  # (its stream current here, as on rank 0's compute thread)
    pool = worker.runner.cache.pool
    assert pool is not None
    while True:
        try:
            name, args, pool.prefix_caching = pickle.loads(calls.recv_bytes())
        except EOFError:
            log.info("rank 0 is gone: rank %d stops", rank)
            logging.shutdown()
            os._exit(0)  # not through the interpreter's teardown: gloo's threads then may abort the process
        try:
            result = getattr(verifier, name)(*args)
            if isinstance(result, StepResult):
                result.per_row()  # what rank 0's reply reads of it, and the blocks given back on reading
        except Exception as exc:  # rank 0 raised the same, and its caller got it
            log.warning("%s failed, as on rank 0: %s", name, exc)
