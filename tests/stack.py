"""Real MineDraft stacks for tests: tiny model pairs on disk, and target/draft/coordinator processes on loopback.

Test modules load this as a plugin (``pytest_plugins = ["stack"]``) so that its session-scoped fixtures exist once
per test session (a fixture imported into several modules would be built once per module). Every process started
here runs ``python -m minedraft_app ...`` with ``OMP_NUM_THREADS=1`` and is stopped (SIGINT, then SIGKILL) in
fixture teardown; it is forked from the session's launcher (``launcher.py``), which has imported torch and
transformers once. Starting a process still costs a second or two (model loading, warm-up), so the worker pair of each
architecture is started once per session and the coordinators, cheaper to replace, come and go around it: a
coordinator must release every sequence it admitted before it stops, so the next one finds the workers clean.

Test modules also import helpers from here before pytest loads it as a plugin, so it is not assertion-rewritten
(PYTEST_DONT_REWRITE: that silences pytest's warning about it).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import itertools
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from launcher import Launcher

from coordinator.main import Coordinator, serve
from coordinator.options import CoordinatorOptions
from minedraft.observability.metrics import CoordinatorMetrics
from minedraft.proto import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generation_pb2,
    generation_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)
from minedraft.rpc.lease import Ticket, presenting
from minedraft_app.stack import free_port, wait_healthy, wait_port_file

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 256
WORKER_MAX_BATCH = 8  # per batch: each worker holds 2 x 8 sequences
EOS_TEXT = "<|endoftext|>"
START_TIMEOUT = 240.0

# One intra-op thread per service: three services share a 2-core CI machine.
SERVICE_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # No HTTP API unless a test asks (--http-port wins): coordinators running at once would all take port 8000.
    "MINEDRAFT_HTTP_PORT": "0",
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
}


# --------------------------------------------------------------------------------------------- tiny models


def stdlib_sources(limit: int = 40) -> list[str]:
    """Paths of stdlib Python files: real text for the tokenizer and for prompts."""
    return sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:limit]


def make_tokenizer(vocab_size: int = 300) -> object:
    """A byte-level BPE tokenizer trained on stdlib sources, as a PreTrainedTokenizerFast (eos id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(stdlib_sources(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TEXT, bos_token=EOS_TEXT, pad_token=EOS_TEXT)


@dataclass(frozen=True)
class TinyPair:
    arch: str
    target: Path
    draft: Path


def _save(model: object, tokenizer: object, directory: Path) -> None:
    model.save_pretrained(directory)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]


def make_tiny_pair(root: Path, arch: str, tokenizer: object) -> TinyPair:
    """A target and a draft sharing `tokenizer`, saved with save_pretrained (the services load them back).

    llama: target hidden 64 x 2 layers, an unrelated draft hidden 32 x 1 layer (acceptance near zero).
    qwen3: llama's shapes in Qwen3 layers (per-head query and key norms).
    gpt2: target hidden 64 x 2 layers (the second one damped); the draft is the target's first layer alone, with
    the same embeddings and head, so that about half the drafts are accepted (every verify outcome shows up).
    """
    import torch
    import transformers

    vocab = len(tokenizer)  # type: ignore[arg-type]
    special: dict[str, Any] = {"eos_token_id": 0, "bos_token_id": 0, "pad_token_id": 0}
    target_dir, draft_dir = root / f"{arch}-target", root / f"{arch}-draft"
    if arch == "llama":
        for directory, hidden, layers, seed in ((target_dir, 64, 2, 0), (draft_dir, 32, 1, 1)):
            torch.manual_seed(seed)
            cfg: transformers.PretrainedConfig = transformers.LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                initializer_range=0.2,
                tie_word_embeddings=False,
                **special,
            )
            _save(transformers.AutoModelForCausalLM.from_config(cfg), tokenizer, directory)
    elif arch == "qwen3":
        for directory, hidden, layers, seed in ((target_dir, 64, 2, 3), (draft_dir, 32, 1, 1)):
            torch.manual_seed(seed)
            cfg = transformers.Qwen3Config(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=512,
                initializer_range=0.2,
                tie_word_embeddings=False,
                **special,
            )
            _save(transformers.AutoModelForCausalLM.from_config(cfg), tokenizer, directory)
    elif arch == "gpt_neox":  # fused Q/K/V, partial rotary: another attention layout than Llama's
        for directory, hidden, layers, seed in ((target_dir, 64, 2, 4), (draft_dir, 32, 1, 1)):
            torch.manual_seed(seed)
            cfg = transformers.GPTNeoXConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=layers,
                num_attention_heads=4,
                max_position_embeddings=512,
                initializer_range=0.2,
                tie_word_embeddings=False,
                **special,
            )
            _save(transformers.AutoModelForCausalLM.from_config(cfg), tokenizer, directory)
    elif arch == "gpt2":
        torch.manual_seed(2)
        cfg = transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_inner=128,
            n_positions=512,
            initializer_range=0.2,
            tie_word_embeddings=False,
            **special,
        )
        target = transformers.AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():  # a quieter second layer: the first-layer draft then agrees about half the time
            for proj in (target.transformer.h[1].attn.c_proj, target.transformer.h[1].mlp.c_proj):
                proj.weight.mul_(0.3)
        _save(target, tokenizer, target_dir)
        draft_cfg = transformers.GPT2Config(**{**cfg.to_dict(), "n_layer": 1})
        draft = transformers.AutoModelForCausalLM.from_config(draft_cfg)
        keep = {k: v for k, v in target.state_dict().items() if ".h.1." not in k}
        draft.load_state_dict(keep, strict=False)
        _save(draft, tokenizer, draft_dir)
    else:
        raise ValueError(f"no tiny pair for {arch}")
    return TinyPair(arch, target_dir, draft_dir)


class TinyPairs:
    """Tiny model pairs for the session, made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tokenizer: object | None = None
        self._pairs: dict[str, TinyPair] = {}

    @property
    def tokenizer(self) -> object:
        if self._tokenizer is None:
            self._tokenizer = make_tokenizer()
        return self._tokenizer

    def __getitem__(self, arch: str) -> TinyPair:
        if arch not in self._pairs:
            self._pairs[arch] = make_tiny_pair(self.root, arch, self.tokenizer)
        return self._pairs[arch]


# --------------------------------------------------------------------------------------------- processes


@dataclass
class Service:
    """One `python -m minedraft_app ...` process listening on a loopback port."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    requested_port: int = 0  # 0: the service binds any free port and writes it to `port_file`
    interrupted: bool = False
    _bound_port: int | None = None

    @property
    def port_file(self) -> Path:
        return self.log_path.with_suffix(".port")

    @property
    def port(self) -> int:
        """The port the service listens on (waits for a service started on port 0 to say which)."""
        if self.requested_port:
            return self.requested_port
        if self._bound_port is None:
            try:
                self._bound_port = wait_port_file(self.port_file, [self.proc], START_TIMEOUT)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(
                    f"{self.name} never said which port it listens on: {exc}\n{self.log_tail()}"
                ) from exc
        return self._bound_port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def interrupt(self) -> None:
        """Send SIGINT once (the services' clean shutdown: the coordinator writes its step trace then)."""
        if self.proc.poll() is None and not self.interrupted:
            self.interrupted = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGINT, then SIGKILL if it has not exited after `timeout` seconds; returns the exit code."""
        self.interrupt()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        return self.proc.returncode


def stop_all(services: Sequence[Service | None]) -> None:
    """Stop several services at once (each takes a few seconds to shut down)."""
    live = [s for s in services if s is not None]
    for service in live:
        service.interrupt()
    for service in live:
        service.stop()


# Ports of this test process's own for the services it starts: below the kernel's ephemeral range, where no port is
# ever handed to a bind to port 0 or to an outgoing connection, and split between the xdist workers. A port that a
# service bound itself (port 0) could be taken, once the service was stopped, by any other process before the test
# restarted a service on it (a worker taken back on its address), and one picked free and bound later (`free_port`)
# likewise: with two workers' stacks on one host, that other process could be the other stack's.
RESERVED_SPAN = 8192  # ports below the ephemeral range, shared by the workers
_RESERVED_LOCK = threading.Lock()
_reserved_next: list[int] = []  # (the next candidate, once a port has been handed out)


def _reserved_range() -> range:
    """This test process's share of the ports below the ephemeral range (empty where there is no room for it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    start = max(low - RESERVED_SPAN, 10_000)  # (above the ports that services are commonly configured on)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    share = (low - start) // max(workers, 1)
    return range(start + index * share, start + (index + 1) * share) if share >= 64 else range(0)


def _bindable(port: int) -> bool:
    """Whether a service can listen on 127.0.0.1 `port` now (as gRPC binds: past connections in TIME_WAIT allowed)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserved_port() -> int:
    """A port for a service that this test process alone hands out (each once, in turn: a stopped service's port is
    its restart's alone), or 0 where there is no room below the ephemeral range (the service then binds a free port
    itself). The first is at a random place in the share: two test sessions on one host start apart."""
    ports = _reserved_range()
    if not ports:
        return 0
    with _RESERVED_LOCK:
        candidate = _reserved_next[0] if _reserved_next else random.SystemRandom().randrange(len(ports))
        for step in range(len(ports)):
            port = ports[(candidate + step) % len(ports)]
            if _bindable(port):  # (another session's, where two share the host)
                _reserved_next[:] = [(candidate + step + 1) % len(ports)]
                return port
    raise RuntimeError(f"no free port left in {ports}")


def server_port() -> int:
    """A port to hand to a server that binds it later (a `--port`, `--http-port` or `--metrics-port`, a rendezvous):
    a `reserved_port`, or one picked free where there is none."""
    return reserved_port() or free_port()


_SPAWNED: list[subprocess.Popen] = []
_LOG_NUMBERS = itertools.count()


@atexit.register
def _kill_leftovers() -> None:
    """A safety net for a test run that dies without its fixture teardowns: no service outlives pytest."""
    for proc in _SPAWNED:
        if proc.poll() is None:
            proc.kill()
    for launcher in _LAUNCHER:
        launcher.stop()


_LAUNCHER: list[Launcher] = []


def _launcher() -> Launcher | None:
    """The session's service launcher (`launcher.py`: services forked with torch and transformers imported),
    started on first use; None where MINEDRAFT_TEST_FORK=0 asks for every service started from scratch."""
    if os.environ.get("MINEDRAFT_TEST_FORK", "1") == "0":
        return None
    if not _LAUNCHER or not _LAUNCHER[0].alive():
        _LAUNCHER[:] = [Launcher(SERVICE_ENV, str(REPO))]
    return _LAUNCHER[0]


def spawn(name: str, args: Sequence[str], log_dir: Path, port: int = 0, env: dict[str, str] | None = None) -> Service:
    """Start `python -m minedraft_app <args> --port <port>`, output to a log file; returns at once.

    Port 0 (the default): a `reserved_port`, which no other process takes while the service runs or after it stops;
    where there is none, the service binds a free port itself (a port picked free here and handed over could be
    taken by another socket in between, seen in CI)."""
    port = port or reserved_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{next(_LOG_NUMBERS)}.log"
    port_file = ["--port-file", str(log_path.with_suffix(".port"))] if port == 0 else []
    full_args = [*args, "--port", str(port), *port_file]
    launcher = _launcher()
    with open(log_path, "w") as log:
        if launcher is not None and launcher.can_start(env or SERVICE_ENV):
            proc: subprocess.Popen = launcher.spawn(full_args, str(log_path), env or SERVICE_ENV)
        else:
            proc = subprocess.Popen(
                [sys.executable, "-m", "minedraft_app", *full_args],
                cwd=REPO,
                env=env or SERVICE_ENV,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    _SPAWNED.append(proc)
    return Service(name, proc, log_path, port)


def wait_all(services: Sequence[Service], timeout: float = START_TIMEOUT) -> None:
    """Wait until every service answers its health check; on failure stop them all and show their logs."""
    try:
        for service in services:
            wait_healthy(service.address, [s.proc for s in services], timeout)
    except BaseException as exc:
        logs = "\n".join(f"--- {s.name} log ---\n{s.log_tail()}" for s in services)
        stop_all(services)
        raise RuntimeError(f"stack did not start: {exc}\n{logs}") from exc


@dataclass
class Workers:
    """A running target service and (unless None) draft service for one tiny pair."""

    pair: TinyPair
    target: Service
    draft: Service | None
    max_batch_size: int

    def stop(self) -> None:
        stop_all([self.draft, self.target])


def worker_args(kind: str, model: Path, max_batch_size: int, device: str = "cpu") -> list[str]:
    return [
        kind,
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--device",
        device,
        "--dtype",
        "float32",
        "--max-batch-size",
        str(max_batch_size),
        "--max-model-len",
        str(MAX_MODEL_LEN),
    ]


def start_workers(
    pair: TinyPair,
    log_dir: Path,
    max_batch_size: int = WORKER_MAX_BATCH,
    with_draft: bool = True,
    target_device: str = "cpu",
    draft_device: str = "cpu",
    extra: Sequence[str] = (),
) -> Workers:
    """Target and draft services of `pair`; `extra`: more flags for both."""
    target_args = worker_args("target", pair.target, max_batch_size, target_device) + list(extra)
    target = spawn(f"{pair.arch}-target", target_args, log_dir)
    draft = None
    if with_draft:
        draft_args = worker_args("draft", pair.draft, max_batch_size, draft_device) + list(extra)
        draft = spawn(f"{pair.arch}-draft", draft_args, log_dir)
    wait_all([s for s in (target, draft) if s is not None])
    return Workers(pair, target, draft, max_batch_size)


def coordinator_args(
    workers: Workers,
    mode: str = "psd",
    *,
    k: int = 4,
    max_batch_size: int = 4,
    max_queue_size: int = 256,
    step_trace: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The `minedraft coordinator` arguments (less --port) for a coordinator in front of `workers`."""
    if max_batch_size > workers.max_batch_size:
        raise ValueError("the workers hold fewer sequences than this coordinator would admit")
    args = [
        "coordinator",
        "--target",
        workers.target.address,
        "--host",
        "127.0.0.1",
        "--mode",
        mode,
        "--num-speculative-tokens",
        str(k),
        "--max-batch-size",
        str(max_batch_size),
        "--max-queue-size",
        str(max_queue_size),
        "--channel",
        "grpc",
        "--tokenizer",
        str(workers.pair.target),
    ]
    if mode != "ar":
        assert workers.draft is not None
        args += ["--draft", workers.draft.address]
    if step_trace is not None:
        args += ["--step-trace", str(step_trace)]
    return args + list(extra)


def start_coordinator(workers: Workers, log_dir: Path, mode: str = "psd", **options: object) -> Service:
    coordinator = spawn(f"coordinator-{workers.pair.arch}-{mode}", coordinator_args(workers, mode, **options), log_dir)  # type: ignore[arg-type]
    wait_all([coordinator])
    return coordinator


@contextlib.contextmanager
def running_coordinator(workers: Workers, log_dir: Path, mode: str = "psd", **options: object) -> Iterator[Service]:
    """A coordinator for the duration of a `with` block; checks the workers are clean afterwards."""
    coordinator = start_coordinator(workers, log_dir, mode, **options)  # type: ignore[arg-type]
    try:
        yield coordinator
    finally:
        code = coordinator.stop()
        if code not in (0, None):
            print(f"coordinator exited with {code}:\n{coordinator.log_tail()}", file=sys.stderr)


@contextlib.asynccontextmanager
async def in_process_coordinator(
    workers: Workers, metrics: CoordinatorMetrics | None = None, **options: Any
) -> AsyncIterator[tuple[str, Coordinator]]:
    """A coordinator served in this process (`coordinator.main.serve`) in front of `workers`, over the grpc channel,
    batches of 4 unless `options` say otherwise, counting into `metrics` if given: (its address, the `Coordinator`), for
    tests that reach into it."""
    assert workers.draft is not None
    settings: dict[str, Any] = dict(
        target=workers.target.address,
        draft=workers.draft.address,
        max_batch_size=4,
        channel="grpc",
        tokenizer=str(workers.pair.target),
    )
    server, port, coordinator = await serve(
        CoordinatorOptions(**{**settings, **options}), 0, "127.0.0.1", metrics=metrics
    )
    try:
        yield f"127.0.0.1:{port}", coordinator
    finally:
        await server.stop(None)
        await coordinator.stop()


# --------------------------------------------------------------------------------------------- clients


@contextlib.asynccontextmanager
async def leased_channel(address: str, kind: str = "target", wait: float = 30.0) -> AsyncIterator[grpc.aio.Channel]:
    """A channel to a worker (`kind`) whose calls present a lease taken for it, as a coordinator's do: for tests
    that call a worker's internal RPCs themselves. Waits out the lease of a coordinator that just died; given up
    on leaving, so that the next coordinator takes the worker at once."""
    ticket = Ticket(f"test/{os.getpid()}/{next(_lease_owners)}")
    async with grpc.aio.insecure_channel(address, interceptors=presenting(ticket)) as channel:
        if kind == "target":
            stub: Any = target_pb2_grpc.TargetServiceStub(channel)
            request: Any = target_pb2.TargetServiceLeaseRequest
        else:
            stub, request = draft_pb2_grpc.DraftServiceStub(channel), draft_pb2.DraftServiceLeaseRequest
        deadline = time.monotonic() + wait
        while True:
            try:
                ticket.epoch = (await stub.Lease(request(owner=ticket.owner), timeout=10)).lease.epoch
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        try:
            yield channel
        finally:
            await stub.Lease(request(owner=ticket.owner, epoch=ticket.epoch, give_up=True), timeout=10)


_lease_owners = itertools.count()


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: int
    usage: generation_pb2.Usage
    messages: int


async def generate(address: str, request: generation_pb2.GenerateRequest, timeout: float = 120.0) -> Completion:
    """One streaming Generate call; raises grpc.aio.AioRpcError on a non-OK status."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return await collect(stub.Generate(request, timeout=timeout))


async def collect(call: grpc.aio.UnaryStreamCall) -> Completion:
    ids: list[int] = []
    text, finish, usage, messages = "", 0, generation_pb2.Usage(), 0
    async for message in call:
        messages += 1
        ids += message.token_ids
        text += message.text
        if message.finish_reason:
            finish, usage = message.finish_reason, message.usage
    return Completion(ids, text, finish, usage, messages)


async def signal_while_streaming(
    address: str, requests: Sequence[generation_pb2.GenerateRequest], pid: int, sig: int = signal.SIGKILL
) -> tuple[list[str], float]:
    """Send process `pid` (a worker, or a rank of one) `sig` once every request has streamed a message: how each
    stream ended (its finish reason, or "CODE: details"), and the seconds from the signal to the last end."""
    started = [asyncio.Event() for _ in requests]

    async def stream(request: generation_pb2.GenerateRequest, first: asyncio.Event) -> str:
        async with grpc.aio.insecure_channel(address) as channel:
            call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=60)
            try:
                async for message in call:
                    first.set()
                    if message.finish_reason:
                        return generation_pb2.FinishReason.Name(message.finish_reason)
            except grpc.aio.AioRpcError as exc:
                first.set()
                return f"{exc.code().name}: {exc.details()}"
        return "no finish"

    tasks = [asyncio.create_task(stream(r, e)) for r, e in zip(requests, started, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    signalled = time.monotonic()
    os.kill(pid, sig)
    ended = list(await asyncio.gather(*tasks))
    return ended, time.monotonic() - signalled


def precapture_spans(log: str) -> list[tuple[float, float]]:
    """Wall-clock (start, end) of each step-shape run ahead of serving that a worker's log reports, in order."""
    spans = []
    for line in log.splitlines():
        took = re.search(r"ahead of serving in ([0-9.]+) s", line)
        if took:
            end = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            spans.append((end - float(took.group(1)), end))
    return spans


def health(address: str, service: str = "") -> int:
    """A server's grpc.health.v1 status for `service` ("": the server as a whole)."""
    with grpc.insecure_channel(address) as channel:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        )


def wait_health(address: str, status: int, timeout: float = 30.0) -> None:
    """Poll `health` until the server as a whole reports `status`."""
    deadline = time.monotonic() + timeout
    while health(address) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.1)


def worker_info(address: str, kind: str) -> common_pb2.WorkerInfo:
    with grpc.insecure_channel(address) as channel:
        if kind == "target":
            return (
                target_pb2_grpc.TargetServiceStub(channel)
                .GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=10)
                .info
            )
        return draft_pb2_grpc.DraftServiceStub(channel).GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=10).info


def assert_all_slots_free(workers: Workers, timeout: float = 10.0) -> None:
    """Poll GetInfo on both workers until every sequence row and KV block is free (requests that ended, however,
    released theirs; cached blocks no one holds count as free); fail with {kind: (free rows, rows, free blocks,
    blocks)} as last seen if some are still held after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {}
        for kind, service in (("target", workers.target), ("draft", workers.draft)):
            if service is not None:
                info = worker_info(service.address, kind)
                seen[kind] = (info.free_slots, info.num_slots, info.free_blocks, info.num_blocks)
        if all(rows == total and blocks == pool for rows, total, blocks, pool in seen.values()):
            return
        assert time.monotonic() < deadline, f"rows or KV blocks still held (free, total, free, total): {seen}"
        time.sleep(0.2)


def text_prompts(tokenizer: object, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[list[int]]:
    """`count` prompts cut from stdlib sources, as token ids, of lengths spread over [min_tokens, max_tokens]."""
    import random

    rng = random.Random(seed)
    corpus = "".join(Path(p).read_text() for p in stdlib_sources(60)[40:48])  # files the tokenizer did not see
    ids = tokenizer.encode(corpus)  # type: ignore[attr-defined]
    prompts = []
    for _ in range(count):
        n = rng.randint(min_tokens, max_tokens)
        start = rng.randrange(0, len(ids) - n)
        prompts.append(ids[start : start + n])
    return prompts


def mixed_requests(tokenizer: object, max_tokens: int = 24) -> list[generation_pb2.GenerateRequest]:
    """Six requests: greedy ones, and sampled ones (top-p, seeded) whose draft probabilities cross the channel."""
    requests = []
    for i, prompt in enumerate(text_prompts(tokenizer, 6, 4, 20, seed=11)):
        params = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        if i % 2:
            params.temperature, params.top_p, params.seed = 0.9, 0.95, 1000 + i
        requests.append(generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params))
    return requests


async def generate_all(address: str, requests: Sequence[generation_pb2.GenerateRequest]) -> list[list[int]]:
    """The token ids of every request, sent at once."""
    done = await asyncio.gather(*(generate(address, r) for r in requests))
    return [c.token_ids for c in done]


def assert_same_top(got: Sequence[tuple[Any, float]], want: Sequence[tuple[Any, float]], tol: float = 1e-5) -> None:
    """Two runs' top logprobs of one position, (token, logprob) most likely first, agree: each value within `tol`,
    and the same token at each rank but where its logprob is within `tol` of a neighbour's (float32 sums of another
    batch shape may swap near-ties)."""
    assert len(got) == len(want), (got, want)
    values = [v for _, v in want]
    for rank, ((token, value), (token_ar, value_ar)) in enumerate(zip(got, want)):
        assert abs(value - value_ar) < tol, (rank, got, want)
        near = [abs(value_ar - v) < tol for v in values[max(rank - 1, 0) : rank] + values[rank + 1 : rank + 2]]
        # (The last rank's near-tie may be with a token beyond the list.)
        assert token == token_ar or any(near) or rank == len(want) - 1, (rank, got, want)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_pairs(tmp_path_factory: pytest.TempPathFactory) -> TinyPairs:
    return TinyPairs(tmp_path_factory.mktemp("stack_models"))


@pytest.fixture(scope="session")
def stack_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack_logs")


@pytest.fixture(scope="session")
def llama_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    """Target and draft services of the tiny Llama pair, shared by every stack test module."""
    workers = start_workers(tiny_pairs["llama"], stack_logs)
    try:
        yield workers
    finally:
        workers.stop()


if __name__ == "__main__":  # python tests/stack.py DIR: write the tiny pairs there (for `minedraft bench`)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny_models")
    out.mkdir(parents=True, exist_ok=True)
    made = TinyPairs(out)
    for name in ("llama", "gpt2"):
        print(made[name])
