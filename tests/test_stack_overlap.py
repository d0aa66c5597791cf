"""PSD overlaps for real: the coordinator's step trace shows Verify(X) and Propose(Y) in flight together."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from stack import TinyPairs, Workers, generate, running_coordinator, text_prompts

from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

BATCH = 4  # per batch; psd holds two
OUTPUT_LEN = 40


@dataclass(frozen=True)
class Event:
    kind: str
    batch_id: int
    batch_size: int
    start: float
    end: float
    worker_compute_s: float = 0.0
    worker_queue_s: float = 0.0
    worker_s: float = 0.0

    def overlaps(self, other: Event) -> bool:
        return self.start < other.end and other.start < self.end


@dataclass
class Trace:
    single: list[Event]  # one request alone: one batch is empty
    full: list[Event]  # 2 x BATCH requests: both batches full


def _request(prompt: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)


@pytest.fixture(scope="module")
def trace(
    llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Trace:
    """One psd coordinator with --step-trace: first a single request, then 2 x BATCH at once; stopped by SIGINT,
    which writes the trace. Event times are the coordinator's time.perf_counter(), CLOCK_MONOTONIC on Linux, a
    clock this process shares, so the phases are told apart by this process's clock."""
    path = tmp_path_factory.mktemp("overlap") / "steps.jsonl"
    prompts = text_prompts(tiny_pairs.tokenizer, 2 * BATCH + 1, 8, 24, seed=3)
    # "auto" may pick sequential steps when they measure faster (a busy 2-core machine), or the target alone (this
    # pair's draft accepts next to nothing); this test is about the overlap mechanism, so it asks for it.
    extra = ["--overlap", "always", "--speculation", "always"]
    with running_coordinator(
        llama_workers, stack_logs, "psd", max_batch_size=BATCH, step_trace=path, extra=extra
    ) as coordinator:

        async def run() -> tuple[float, float]:
            await generate(coordinator.address, _request(prompts[0], 24))
            between = time.perf_counter()
            done = await asyncio.gather(*(generate(coordinator.address, _request(p, OUTPUT_LEN)) for p in prompts[1:]))
            assert all(len(c.token_ids) == OUTPUT_LEN for c in done)
            return between, time.perf_counter()

        start = time.perf_counter()
        between, end = asyncio.run(run())
    assert path.exists(), f"no step trace written:\n{coordinator.log_tail()}"
    fields = Event.__dataclass_fields__
    events = [
        Event(**{k: v for k, v in json.loads(line).items() if k in fields})
        for line in path.read_text().splitlines()
        if line.strip()
    ]
    assert events and all(start <= e.start and e.end <= end for e in events), "trace clock differs from ours"
    return Trace([e for e in events if e.end <= between], [e for e in events if e.start >= between])


def test_both_batches_full_verify_and_propose_overlap(trace: Trace) -> None:
    verifies = [e for e in trace.full if e.kind == "verify"]
    proposes = [e for e in trace.full if e.kind == "propose"]
    full_steps = overlapped = 0
    for v in verifies:
        if v.batch_size != BATCH:
            continue
        # The other batch's latest proposal that began before this verify ended: was that batch full too?
        other = [p for p in proposes if p.batch_id != v.batch_id and p.start < v.end]
        if not other or max(other, key=lambda p: p.start).batch_size != BATCH:
            continue
        full_steps += 1
        overlapped += any(p.overlaps(v) for p in other)
    assert full_steps >= OUTPUT_LEN // 2, f"only {full_steps} verify steps with both batches full"
    assert overlapped >= 0.9 * full_steps, f"{overlapped} of {full_steps} full verify steps overlapped a propose"
    # Both batches take turns: each is verified about as often as the other.
    per_batch = [sum(1 for v in verifies if v.batch_id == b) for b in (0, 1)]
    assert min(per_batch) >= 0.8 * max(per_batch), per_batch


def test_single_request_runs_sequential_sd(trace: Trace) -> None:
    steps = sorted((e for e in trace.single if e.kind in ("propose", "verify")), key=lambda e: e.start)
    assert len(steps) >= 2 * 4, f"too few steps: {steps}"
    proposes = [e for e in steps if e.kind == "propose"]
    verifies = [e for e in steps if e.kind == "verify"]
    assert not [(p, v) for p in proposes for v in verifies if p.overlaps(v)], "propose and verify overlapped"
    # Propose then verify on the same batch, alternating.
    assert [e.kind for e in steps] == ["propose", "verify"] * (len(steps) // 2)
    assert all(p.batch_id == v.batch_id and p.end <= v.start for p, v in zip(steps[::2], steps[1::2]))
    assert all(e.batch_size == 1 for e in steps)


def test_each_call_reports_its_wait_and_its_work_inside_the_call(trace: Trace) -> None:
    """A worker's reply says how long the call waited for the compute thread, how long it ran there, and how long
    its handler took: each within the next, and the handler within the call as the coordinator timed it."""
    calls = [e for e in trace.single + trace.full if e.kind in ("prefill", "propose", "verify")]
    assert calls
    for e in calls:
        assert e.worker_compute_s > 0 and e.worker_queue_s >= 0, e
        # The handler (wall clock, time.time) holds the wait and the work; the call holds the handler.
        assert e.worker_queue_s + e.worker_compute_s <= e.worker_s + 1e-3, e
        assert e.worker_s <= e.end - e.start + 1e-3, e
