"""A target service that dies, hangs or is replaced, and comes back on its address.

The requests it held end with UNAVAILABLE (their clients may send them again), new ones are refused while it is gone
(health NOT_SERVING), and once it answers the coordinator sets the channel up again and serves, losslessly."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from stack import (
    Completion,
    Service,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate,
    health,
    running_coordinator,
    signal_while_streaming,
    spawn,
    start_workers,
    text_prompts,
    wait_all,
    wait_health,
    worker_args,
)

from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

LOST = "UNAVAILABLE: the target service became unreachable or restarted before this request finished: send it again"


def _requests(tiny_pairs: TinyPairs) -> list[generation_pb2.GenerateRequest]:
    params = generation_pb2.SamplingParams(max_tokens=120, ignore_eos=True)
    return [
        generation_pb2.GenerateRequest(prompt_token_ids=p, params=params)
        for p in text_prompts(tiny_pairs.tokenizer, 6, 4, 20, seed=31)
    ]


def _wave(address: str, requests: list[generation_pb2.GenerateRequest]) -> list[Completion | str]:
    """Each request's completion, or how its call failed (code: details)."""

    async def one(request: generation_pb2.GenerateRequest) -> Completion | str:
        try:
            return await generate(address, request, timeout=60)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"

    async def run_all() -> list[Completion | str]:
        return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(run_all())


def _until_served(
    address: str, requests: list[generation_pb2.GenerateRequest], timeout: float = 30.0
) -> list[Completion]:
    """The wave, sent again (as a client would on UNAVAILABLE) until every request of it is served."""
    deadline = time.monotonic() + timeout
    while True:
        wave = _wave(address, requests)
        if all(isinstance(c, Completion) for c in wave):
            return wave  # type: ignore[return-value]
        assert time.monotonic() < deadline, wave
        time.sleep(0.2)


# The workers' drain timeout (a restarted target's too): what a SIGTERM'd target may take; a kill or stop ignores it.
WORKER_EXTRA = ["--drain-timeout", "120"]


@pytest.fixture(scope="module")
def loss_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    """A llama pair of this module's own, its target replaced by each test that ends it (a start costs seconds)."""
    workers = start_workers(tiny_pairs["llama"], stack_logs / "target-loss", extra=WORKER_EXTRA)
    try:
        yield workers
    finally:
        workers.stop()


def _restart_target(workers: Workers, log_dir: Path) -> None:
    restarted = spawn(
        "llama-target-restarted",
        worker_args("target", workers.pair.target, workers.max_batch_size) + WORKER_EXTRA,
        log_dir,
        port=workers.target.port,
    )
    workers.target = restarted
    wait_all([restarted])


@contextlib.contextmanager
def _served_stack(
    tiny_pairs: TinyPairs, workers: Workers, stack_logs: Path, coordinator_extra: Sequence[str]
) -> Iterator[tuple[Workers, Service, list[generation_pb2.GenerateRequest], list[Completion]]]:
    """The module's llama pair (its target alive) and a psd coordinator (`coordinator_extra`) that has served
    `_requests` in full once: (workers, coordinator, the requests, their completions). Every KV row must be free
    afterwards."""
    assert workers.target.proc.poll() is None, "a test before left the target stopped"
    requests = _requests(tiny_pairs)
    with running_coordinator(workers, stack_logs, "psd", extra=list(coordinator_extra)) as coordinator:
        expected = _wave(coordinator.address, requests)
        completions = [c for c in expected if isinstance(c, Completion) and len(c.token_ids) == 120]
        assert len(completions) == len(expected), expected
        yield workers, coordinator, requests, completions
    assert_all_slots_free(workers, timeout=15)


def test_a_restarted_target_service_is_taken_back(
    tiny_pairs: TinyPairs, loss_workers: Workers, stack_logs: Path
) -> None:
    stack = _served_stack(tiny_pairs, loss_workers, stack_logs, ["--draft-retry-interval", "0.2"])
    with stack as (workers, coordinator, requests, expected):
        address = coordinator.address
        # Killed while serving: every request it held ends with UNAVAILABLE; while it is gone, the coordinator
        # says NOT_SERVING and refuses new requests at once.
        ended = asyncio.run(signal_while_streaming(address, requests, workers.target.proc.pid))[0]
        assert ended == [LOST] * len(requests), ended
        wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING  # not to be restarted
        refused = _wave(address, requests[:1])
        assert isinstance(refused[0], str) and refused[0].startswith(
            "UNAVAILABLE: the target service is unreachable"
        ), refused

        # Back on its address: the coordinator sets the channel up again and serves the same tokens.
        _restart_target(workers, stack_logs / "target-loss")
        wait_health(address, health_pb2.HealthCheckResponse.SERVING)
        after = _wave(address, requests)
        assert [c.token_ids for c in after] == [c.token_ids for c in expected]  # type: ignore[union-attr]

        # Killed while the coordinator is idle: its health watch sees the connection break, so it says
        # NOT_SERVING with no request sent (before, it said SERVING until a request's call failed).
        workers.target.proc.send_signal(signal.SIGKILL)
        workers.target.proc.wait()
        wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        assert "target service lost (its connection broke" in coordinator.log_tail(100_000)
        _restart_target(workers, stack_logs / "target-loss")
        wait_health(address, health_pb2.HealthCheckResponse.SERVING)
        again = _wave(address, requests)
        assert [c.token_ids for c in again] == [c.token_ids for c in expected]  # type: ignore[union-attr]


def test_a_hung_target_service_is_dropped_then_taken_back(
    tiny_pairs: TinyPairs, loss_workers: Workers, stack_logs: Path
) -> None:
    """A target process that stops answering (SIGSTOP) costs its requests after a --target-timeout, not the
    coordinator: once it runs again (still holding the old sequences, released then) the coordinator serves again."""
    stack = _served_stack(
        tiny_pairs, loss_workers, stack_logs, ["--draft-retry-interval", "0.2", "--target-timeout", "1"]
    )
    with stack as (workers, coordinator, requests, expected):
        address = coordinator.address
        target = workers.target.proc
        try:
            ended = asyncio.run(signal_while_streaming(address, requests, target.pid, signal.SIGSTOP))[0]
            assert ended == [LOST] * len(requests), ended
            wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        finally:
            target.send_signal(signal.SIGCONT)
        after = _until_served(address, requests)
        assert [c.token_ids for c in after] == [c.token_ids for c in expected]  # type: ignore[union-attr]


def test_a_target_terminated_alone_finishes_what_was_admitted(
    tiny_pairs: TinyPairs, loss_workers: Workers, stack_logs: Path
) -> None:
    """A SIGTERM to the target service alone (its pod replaced): the coordinator follows the target's health,
    reports NOT_SERVING (liveness SERVING) and refuses new requests, so the admitted ones finish on the draining
    target, which then stops on its own, long before its drain timeout; a new target on its address is taken back
    and serves the same tokens. Before, the coordinator kept admitting onto the draining target, whose drain timeout
    then cut off whatever was running."""
    stack = _served_stack(tiny_pairs, loss_workers, stack_logs, ["--draft-retry-interval", "0.2"])
    with stack as (workers, coordinator, requests, expected):
        address = coordinator.address
        ended = asyncio.run(signal_while_streaming(address, requests, workers.target.proc.pid, signal.SIGTERM))[0]
        assert ended == ["FINISH_REASON_LENGTH"] * len(requests), ended
        # The target serves on until no call has come for 5 s: meanwhile the coordinator refuses new requests.
        wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        assert health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING
        refused = _wave(address, requests[:1])
        assert isinstance(refused[0], str) and refused[0].startswith(
            "UNAVAILABLE: the target service is shutting down"
        ), refused
        assert workers.target.proc.wait(timeout=30) == 0, workers.target.log_tail()

        _restart_target(workers, stack_logs / "target-loss")
        wait_health(address, health_pb2.HealthCheckResponse.SERVING)
        after = _wave(address, requests)
        assert [c.token_ids for c in after] == [c.token_ids for c in expected]  # type: ignore[union-attr]
        assert "the target service is shutting down" in coordinator.log_tail(100_000)
