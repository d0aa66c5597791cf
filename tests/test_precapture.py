"""--precapture-graphs: the steps run ahead of serving cover every step shape that serving then runs.

On a GPU each of those shapes is a CUDA graph captured at connect time instead of while requests wait; the shapes
(graph keys) are the same on every device, so the CPU checks that none is missed: greedy, sampled and top-k/top-p
proposals, verifies, batches of every size, sequences growing through several key-length buckets.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2
from stack import (
    TinyPairs,
    Workers,
    generate_all,
    mixed_requests,
    precapture_spans,
    run_async,
    running_coordinator,
    spawn,
    start_workers,
    wait_all,
    wait_health,
    worker_args,
)

from coordinator.pairing import prepare_worker
from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import generation_pb2, target_pb2, target_pb2_grpc
from minedraft_app.offline import OfflineRequest, generate_offline
from target_service.verifier import Verifier

pytest_plugins = ["stack"]
K, MAX_BATCH, MAX_LEN, VOCAB = 3, 5, 200, 128


def _requests() -> list[OfflineRequest]:
    rng = random.Random(4)
    configs = [
        SamplingConfig(max_tokens=120, ignore_eos=True),
        SamplingConfig(temperature=0.8, seed=1, max_tokens=120, ignore_eos=True),
        SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, seed=2, max_tokens=120, ignore_eos=True),
    ]
    lengths = [4] + [rng.randint(3, 60) for _ in range(8)]  # a prompt as short as a verify step: prefills stay eager
    prompts = [[rng.randrange(VOCAB) for _ in range(length)] for length in lengths]
    return [OfflineRequest(prompt, configs[i % 3], arrival_step=2 * i) for i, prompt in enumerate(prompts)]


def test_precaptured_shapes_cover_what_serving_runs(tiny_models) -> None:
    # As the workers have them: rows for two batches of MAX_BATCH (padded to 8 rows for 5).
    verifier = Verifier(ModelRunner(tiny_models.target("llama", vocab=VOCAB), 2 * MAX_BATCH, MAX_LEN), [])
    proposer = Proposer(ModelRunner(tiny_models.draft("llama", vocab=VOCAB), 2 * MAX_BATCH, MAX_LEN))
    shapes = verifier.precapture(K, MAX_BATCH), proposer.precapture(K, MAX_BATCH)
    # Batch buckets 1, 2, 4, 8 (up to 5 rows) x key lengths 64, 128, 192, 200 (a CPU gathers K/V by key-length
    # bucket; CUDA's paged steps have no key length); three kinds of verify and proposal, and the target's three
    # kinds of step alone.
    assert shapes == (6 * 16, 3 * 16)
    ahead = [set(verifier.runner.step_keys), set(proposer.runner.step_keys)]
    assert verifier.runner.cache.lengths.sum() == 0 and proposer.runner.cache.lengths.sum() == 0
    assert verifier.runner.free_slots == proposer.runner.free_slots == 2 * MAX_BATCH

    verifier.runner.step_keys.clear()
    proposer.runner.step_keys.clear()
    results = generate_offline(verifier, proposer, _requests(), K, MAX_BATCH)
    assert all(len(r.tokens) == 120 for r in results)
    served = [verifier.runner.step_keys, proposer.runner.step_keys]
    assert served[0] <= ahead[0] and served[1] <= ahead[1], (
        f"not run ahead: {served[0] - ahead[0]}, {served[1] - ahead[1]}"
    )
    # The load went through several batch sizes, key-length buckets and kinds of verify and proposal. Keys are
    # (kind, forwards, padded batch, key length, the inputs' shapes...).
    assert len({key[2] for key in served[0]}) >= 3 and len({key[3] for key in served[0]}) >= 3
    assert {key[0] for key in served[0]} == {"verify-greedy", "verify-sampled", "verify-filtered"}
    assert {key[0] for key in served[1]} == {"greedy", "sampled", "filtered"}
    verifier.runner.step_keys.clear()
    results = generate_offline(verifier, None, _requests(), 0, MAX_BATCH)  # the target alone
    assert all(len(r.tokens) == 120 for r in results)
    assert verifier.runner.step_keys <= ahead[0], f"not run ahead: {verifier.runner.step_keys - ahead[0]}"


def test_workers_run_their_shapes_when_the_coordinator_connects(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path
) -> None:
    """The flag through real services: both workers run their step shapes when a coordinator connects, once for
    each draft length and batch size (psd's two batches share them with sd's one) and both workers at once, and
    then serve as usual (the same tokens as workers without the flag: the session's)."""
    requests = mixed_requests(tiny_pairs.tokenizer)
    outputs: dict[str, list[object]] = {"sd": [], "psd": []}
    for extra in ([], ["--precapture-graphs"]):
        workers = start_workers(tiny_pairs["llama"], stack_logs, extra=extra) if extra else llama_workers
        try:
            for mode in ("sd", "psd", "psd"):  # psd and its reconnect find sd's shapes run
                # (Drafting at every step: under `auto` the timing decides where drafts run, and the seeded samples
                # follow the drafts they met.)
                always = ["--speculation", "always"]
                with running_coordinator(workers, stack_logs, mode, k=4, max_batch_size=4, extra=always) as coordinator:
                    outputs[mode].append(run_async(generate_all(coordinator.address, requests)))
            logs = [workers.target.log_tail(10**7), workers.draft.log_tail(10**7)]  # type: ignore[union-attr]
        finally:
            if workers is not llama_workers:
                workers.stop()
        ran = [re.findall(r"ran (\d+) step shapes", log) for log in logs]
        # Buckets 1, 2, 4 x key lengths 64, 128, 192, 256; three kinds of verify (and of the target's step alone)
        # and of proposal.
        assert ran == ([["12"] * 6, ["12"] * 3] if extra else [[], []]), logs
        if extra:  # the coordinator's Prepare calls: both workers at once, not one after the other
            (target_start, target_end), (draft_start, draft_end) = (
                (spans[0][0], spans[2][1]) for spans in map(precapture_spans, logs)
            )
            assert target_start < draft_end and draft_start < target_end, logs
    assert all(len(set(map(repr, runs))) == 1 for runs in outputs.values()), "precapture changed the output"


def test_an_ar_coordinator_prepares_its_target_and_a_restarted_one(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path
) -> None:
    """With no draft to connect (ar), the coordinator still calls the target's Prepare, at its start and when it takes
    a restarted target back: the one-token steps' shapes run before serving, for one batch, and serving gives the
    same tokens as an unprepared target's (the session's)."""
    requests = mixed_requests(tiny_pairs.tokenizer)
    outputs, logs = [], []
    for extra in ([], ["--precapture-graphs"]):
        if extra:
            workers = start_workers(tiny_pairs["llama"], stack_logs, with_draft=False, extra=extra)
        else:
            workers = Workers(llama_workers.pair, llama_workers.target, None, llama_workers.max_batch_size)
        try:
            with running_coordinator(
                workers, stack_logs, "ar", k=4, max_batch_size=4, extra=["--draft-retry-interval", "0.2"]
            ) as coordinator:
                outputs.append(run_async(generate_all(coordinator.address, requests)))
                if extra:  # killed and restarted on its address: taken back, and prepared before it serves again
                    logs.append(workers.target.log_tail(10**7))
                    workers.target.proc.send_signal(signal.SIGKILL)
                    workers.target.proc.wait()
                    # (the idle coordinator's health watch sees it go)
                    wait_health(coordinator.address, health_pb2.HealthCheckResponse.NOT_SERVING)
                    workers.target = spawn(
                        "llama-target-restarted",
                        worker_args("target", workers.pair.target, workers.max_batch_size) + extra,
                        stack_logs,
                        port=workers.target.port,
                    )
                    wait_all([workers.target])
                    outputs.append(_served_again(coordinator.address, requests))
            logs.append(workers.target.log_tail(10**7))
        finally:
            if workers.target is not llama_workers.target:
                workers.stop()
    # Buckets 1, 2, 4 x key lengths 64, 128, 192, 256, for each of the three kinds of verify, of one token (n=1)
    ran = [re.findall(r"ran (\d+) step shapes \(n=(\d+)\)", log) for log in logs]
    assert ran == [[], [("12", "1")] * 3, [("12", "1")] * 3], logs
    assert outputs[0] == outputs[1] == outputs[2]


def _served_again(
    address: str, requests: list[generation_pb2.GenerateRequest], timeout: float = 60.0
) -> list[list[int]]:
    """The requests' tokens once the coordinator serves again (UNAVAILABLE while it takes the target back)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return run_async(generate_all(address, requests))  # type: ignore[return-value]
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, error
            time.sleep(0.2)


def test_a_worker_without_prepare_is_prepared_by_its_setup_channel() -> None:
    """A worker older than the Prepare RPC (a rolling upgrade starts the new coordinator first) answers UNIMPLEMENTED:
    the coordinator goes on to SetupChannel, which prepares such a worker. Any other error still fails the connect."""

    class Refusing(target_pb2_grpc.TargetServiceServicer):
        async def Prepare(self, request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of GPU memory")

    async def prepare(servicer: target_pb2_grpc.TargetServiceServicer) -> None:
        server = grpc.aio.server()
        target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                await prepare_worker(stub.Prepare, [target_pb2.TargetServicePrepareRequest(num_speculative_tokens=4)])
        finally:
            await server.stop(None)

    asyncio.run(prepare(target_pb2_grpc.TargetServiceServicer()))  # the generated base: every RPC unimplemented
    try:
        asyncio.run(prepare(Refusing()))
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        raise AssertionError("a worker's failed Prepare passed for an old worker's")
