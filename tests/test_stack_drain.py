"""A SIGTERM drains the coordinator: admitted requests finish, new ones get UNAVAILABLE, health says NOT_SERVING."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack import TinyPairs, Workers, assert_all_slots_free, start_coordinator, start_workers, text_prompts

from minedraft.proto import generation_pb2, generation_pb2_grpc
from minedraft.rpc.server_utils import LIVENESS

pytest_plugins = ["stack"]

# All running at the SIGTERM (two batches of 8): a request still on its way then is refused, and one in the queue
# streams nothing to tell the client it was admitted.
REQUESTS = 12
MAX_TOKENS = 200


def _request(prompt: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    )


async def _stream(
    call: grpc.aio.UnaryStreamCall[Any, generation_pb2.GenerateResponse], started: asyncio.Event
) -> tuple[int, str]:
    """(tokens received, how it ended: the finish reason's name, or the status code's and its details) of one
    Generate call; `started` is set at its first message."""
    tokens, finish = 0, 0
    try:
        async for message in call:
            started.set()
            tokens += len(message.token_ids)
            finish = message.finish_reason or finish
    except grpc.aio.AioRpcError as exc:
        return tokens, f"{exc.code().name}: {exc.details()}"
    return tokens, generation_pb2.FinishReason.Name(finish)


async def _not_serving_but_alive(channel: grpc.aio.Channel) -> None:
    """Wait until a server's health says NOT_SERVING; its liveness service must still say SERVING then."""
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 30
    while (
        await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
    ).status == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "health still SERVING 30 s after the SIGTERM"
        await asyncio.sleep(0.02)
    liveness = await health.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=10)
    assert liveness.status == health_pb2.HealthCheckResponse.SERVING  # a liveness probe must not kill a drain


async def _terminate_under_load(
    address: str, procs: list[object], prompts: list[list[int]], workers: Sequence[str] = ()
) -> tuple[list[tuple[int, str]], bool, grpc.StatusCode, str]:
    """Start the requests, SIGTERM `procs` (the coordinator's, maybe the workers' too) once each streams, then once
    the coordinator's health (and that of the `workers` addresses) says NOT_SERVING send one more request. Returns
    (each request's (tokens, finish reason), whether some were still unfinished when the drain had begun, the late
    request's status code and details)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        started = [asyncio.Event() for _ in prompts]
        tasks = [
            asyncio.create_task(_stream(stub.Generate(_request(p), timeout=120), event))
            for p, event in zip(prompts, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
        for proc in procs:
            proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        await _not_serving_but_alive(channel)
        unfinished = not all(t.done() for t in tasks)
        for worker in workers:
            async with grpc.aio.insecure_channel(worker) as worker_channel:
                await _not_serving_but_alive(worker_channel)
        try:
            await stub.Generate(_request(prompts[0]), timeout=30).read()
            late = (grpc.StatusCode.OK, "")
        except grpc.aio.AioRpcError as exc:
            late = (exc.code(), exc.details() or "")
        return list(await asyncio.gather(*tasks)), unfinished, *late


def _exit_code(proc: object, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.1)
    return proc.poll()  # type: ignore[attr-defined]


def test_sigterm_lets_admitted_requests_finish_and_refuses_new_ones(
    llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path
) -> None:
    coordinator = start_coordinator(
        llama_workers, stack_logs, "psd", max_batch_size=8, extra=["--drain-timeout", "120"]
    )
    try:
        prompts = text_prompts(tiny_pairs.tokenizer, REQUESTS, 4, 40, seed=3)
        results, unfinished, code, details = asyncio.run(
            _terminate_under_load(coordinator.address, [coordinator.proc], prompts)
        )
        assert unfinished  # the drain had requests to wait for
        assert results == [(MAX_TOKENS, "FINISH_REASON_LENGTH")] * REQUESTS
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details, (code, details)
        assert _exit_code(coordinator.proc, 30) == 0, coordinator.log_tail()
    finally:
        coordinator.stop()
    assert_all_slots_free(llama_workers, timeout=15)


def test_a_drain_ends_at_its_timeout(llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path) -> None:
    """Requests still open when the drain timeout passes end with UNAVAILABLE after the tokens
    they were sent, so their clients can send them elsewhere; the coordinator exits."""
    coordinator = start_coordinator(
        llama_workers, stack_logs, "psd", max_batch_size=8, extra=["--drain-timeout", "0.2"]
    )
    try:
        prompts = text_prompts(tiny_pairs.tokenizer, REQUESTS, 4, 40, seed=4)
        results, _, code, _ = asyncio.run(_terminate_under_load(coordinator.address, [coordinator.proc], prompts))
        stopped = "UNAVAILABLE: the coordinator stopped before this request finished: send it again"
        assert stopped in {end for _, end in results} <= {"FINISH_REASON_LENGTH", stopped}, results
        assert all(tokens < MAX_TOKENS for tokens, end in results if end == stopped), results
        assert code == grpc.StatusCode.UNAVAILABLE, code  # draining, or (after the drain) no server
        assert _exit_code(coordinator.proc, 20) == 0, coordinator.log_tail()
    finally:
        coordinator.stop()
    assert_all_slots_free(llama_workers, timeout=15)


def test_a_stack_terminated_all_at_once_finishes_its_requests(tiny_pairs: TinyPairs, stack_logs: Path) -> None:
    """A release deleted at once: the coordinator and both workers get their SIGTERMs together. The workers serve on
    while the coordinator drains (they stop once no call has come for a while), so every admitted request finishes
    and all three exit 0. Workers that stopped at their SIGTERM failed them all."""
    workers = start_workers(tiny_pairs["llama"], stack_logs / "terminated-together")
    assert workers.draft is not None
    coordinator = start_coordinator(workers, stack_logs, "psd", max_batch_size=8, extra=["--drain-timeout", "120"])
    try:
        prompts = text_prompts(tiny_pairs.tokenizer, REQUESTS, 4, 40, seed=5)
        services = [coordinator, workers.target, workers.draft]
        results, unfinished, code, _ = asyncio.run(
            _terminate_under_load(
                coordinator.address,
                [s.proc for s in services],
                prompts,
                [workers.target.address, workers.draft.address],
            )
        )
        assert unfinished  # the drain had requests to wait for
        assert results == [(MAX_TOKENS, "FINISH_REASON_LENGTH")] * REQUESTS, results
        assert code == grpc.StatusCode.UNAVAILABLE, code
        for service in services:
            assert _exit_code(service.proc, 40) == 0, service.log_tail()
        assert "draining: serving until no call has come" in workers.target.log_tail(100_000)
    finally:
        coordinator.stop()
        workers.stop()
