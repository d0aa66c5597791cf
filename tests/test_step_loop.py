"""The step loop's policies against scripted fake workers (tests/fakes.py), on the CPU, in milliseconds: admission,
balance, losslessness in every mode, preemption, room refused, fallback to SD, a draft or target lost and taken back,
overlap, speculation, drain and a fault of the step's own."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import grpc
import pytest
from fakes import Call, CallLog, FakeDraft, FakeTarget, Harness, expected, rpc_error, run

from coordinator.batch_manager import Batch
from coordinator.pairing import Layout
from coordinator.request_state import RequestState
from coordinator.step_loop import MODES, Unavailable
from coordinator.workers import Workers
from minedraft.errors import ModelLoadError
from minedraft.proto import generation_pb2

LENGTH = generation_pb2.FINISH_REASON_LENGTH
Code = grpc.StatusCode


def assert_lossless(h: Harness, requests: list[RequestState]) -> None:
    """Each request's client got the fake target's own sequence, whole, and its stream ended at max_tokens."""
    for request in requests:
        got = h.received(request)
        assert got.error is None, got.error
        assert got.tokens == expected(request), request
        assert got.finish_reason == LENGTH
        assert got.usage is not None and got.usage.completion_tokens == request.config.max_tokens


async def assert_all_released(h: Harness) -> None:
    """Once the releases no call took are sent, the workers hold nothing."""
    await h.workers.flush_releases(always=True)
    assert not h.target.sequences
    assert h.draft is None or not h.draft.sequences


def test_psd_admits_a_burst_within_max_prefill_tokens_into_balanced_batches() -> None:
    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, prompt_len=8, max_tokens=12) for seq_id in range(1, 8)]
        while h.manager.waiting:
            await h.loop.step()
            sizes = [b.size for b in h.manager.batches]
            assert max(sizes) - min(sizes) <= 1, sizes
        prefills = h.log.of("target", "Prefill")
        assert [len(c.request.sequences) for c in prefills] == [2, 2, 2, 1]  # 20 tokens a prefill: two prompts of 8
        assert [len(c.request.sequences) for c in h.log.of("draft", "Prefill")] == [2, 2, 2, 1]
        await h.finish(requests)
        assert_lossless(h, requests)
        await assert_all_released(h)

    run(test, max_prefill_tokens=20)


@pytest.mark.parametrize("mode", MODES)
def test_output_is_the_targets_own_sequence_with_requests_joining_midway(mode: str) -> None:
    async def test(h: Harness) -> None:
        first = [h.submit(seq_id, prompt_len=5 + seq_id, max_tokens=8 + 3 * seq_id) for seq_id in range(1, 4)]
        await h.step_until(lambda: len(h.log.of("target", "Verify")) >= 3)
        later = [h.submit(seq_id, prompt_len=seq_id, max_tokens=2 * seq_id) for seq_id in range(4, 7)]
        await h.finish(first + later)
        assert_lossless(h, first + later)
        verifies = h.log.of("target", "Verify")
        drafted = sum(c.request.num_draft_tokens > 0 for c in verifies)
        assert drafted == (0 if mode == "ar" else len(verifies))
        await assert_all_released(h)

    run(test, mode=mode, draft={"wrong_every": 3})


def test_few_free_kv_blocks_preempt_and_the_preempted_request_ends_with_the_same_tokens() -> None:
    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, prompt_len=8, max_tokens=40) for seq_id in range(1, 4)]
        await h.finish(requests)
        assert h.loop.admission.preemptions >= 1
        resumed = [s for c in h.log.of("target", "Prefill") for s in c.request.sequences if s.output_tokens]
        assert resumed, "a preempted request is prefilled again with its output so far"
        assert not [c for c in h.log.calls if c.error is not None]  # the target never ran out of blocks
        assert_lossless(h, requests)
        await assert_all_released(h)

    run(test, target={"num_blocks": 24})  # 3 requests of up to 47 tokens need 36 blocks of 4


def test_a_prefill_refused_for_room_waits_until_a_running_sequence_leaves() -> None:
    async def test(h: Harness) -> None:
        running = h.submit(1, max_tokens=30)
        await h.step_until(lambda: len(running.output_ids) >= 3)
        h.target.fail("Prefill", Code.RESOURCE_EXHAUSTED)
        waiting = h.submit(2, max_tokens=10)
        await h.finish([running, waiting])
        prefills = [c for c in h.log.of("target", "Prefill") if c.request.sequences[0].seq_id == 2]
        assert [c.error for c in prefills] == [Code.RESOURCE_EXHAUSTED, None]
        last_of_running = max(c.end for c in h.log.of("target", "Verify") if 1 in c.request.seq_ids)
        assert prefills[1].start > last_of_running
        assert_lossless(h, [running, waiting])
        await assert_all_released(h)

    run(test)


def test_a_prefill_refused_for_room_with_nothing_running_fails_its_request() -> None:
    async def test(h: Harness) -> None:
        h.target.fail("Prefill", Code.RESOURCE_EXHAUSTED)
        alone = h.submit(1)
        await h.finish([alone])
        error = h.received(alone).error
        assert isinstance(error, grpc.aio.AioRpcError) and error.code() == Code.RESOURCE_EXHAUSTED
        assert "even with nothing else running" in str(error.details())
        after = h.submit(2)
        await h.finish([after])
        assert_lossless(h, [after])

    run(test)


def test_psd_with_one_batch_empty_drafts_and_verifies_it_in_one_step() -> None:
    async def test(h: Harness) -> None:
        alone = h.submit(1, max_tokens=20)
        steps = await h.finish([alone])
        calls = [c for c in h.log.calls if c.method in ("Propose", "Verify")]
        assert [c.method for c in calls] == ["Propose", "Verify"] * steps
        assert all(c.request.batch_id == 0 for c in calls)
        assert all(c.request.num_draft_tokens == 3 for c in calls if c.method == "Verify")
        usage = h.received(alone).usage
        assert usage is not None and usage.drafted_steps == usage.steps == steps
        assert alone.output_ids == expected(alone)

    run(test, draft={"wrong_every": 2})


@pytest.mark.parametrize("fault", ["unavailable", "hung"])
def test_a_lost_draft_leaves_the_target_alone_until_a_probe_hands_it_back(fault: str) -> None:
    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, max_tokens=60) for seq_id in range(1, 5)]
        await h.step_until(lambda: all(len(r.output_ids) >= 4 for r in requests))
        if fault == "unavailable":
            h.draft.down = True
        else:
            h.draft.hang("Propose")
        failover = h.workers.failover
        await h.step_until(lambda: not failover.draft_connected)
        lost_at = h.log.tick()

        def alone() -> int:
            return sum(c.start > lost_at and not c.request.num_draft_tokens for c in h.log.of("target", "Verify"))

        await h.step_until(lambda: alone() >= 3)
        h.draft.down = False
        await h.step_until(lambda: failover.draft_connected)
        probes = [c.error for c in h.log.of("draft", "GetInfo") if c.start > lost_at]
        assert probes[-1] is None and (fault == "hung" or Code.UNAVAILABLE in probes)
        # The lost draft's channel closed on the target once the drafts made before the loss were verified (they are
        # on that channel), then a fresh one set up: the draft exports, the target attaches.
        setups = [c for c in h.log.calls if c.method == "SetupChannel" and c.start > lost_at]
        closes = [c for c in setups if c.request.close]
        assert [c.worker for c in closes] == ["target"]
        drafted = [c for c in h.log.of("target", "Verify") if c.request.num_draft_tokens]
        assert all(c.end < closes[0].start for c in drafted if c.start < closes[0].start)
        fresh = [(c.worker, c.error) for c in setups if not c.request.close][-2:]
        assert fresh == [("draft", None), ("target", None)]
        handed = h.log.of("draft", "Prefill")[-1]
        assert handed.start > lost_at and handed.error is None
        assert {s.seq_id for s in handed.request.sequences} == {r.seq_id for r in requests}
        assert all(s.output_tokens for s in handed.request.sequences)  # each with its output so far (resume)
        back_at = h.log.tick()
        await h.finish(requests)
        assert any(c.start > back_at and c.request.num_draft_tokens for c in h.log.of("target", "Verify"))
        assert_lossless(h, requests)
        await assert_all_released(h)

    run(test, draft_timeout=0.05)


@pytest.mark.parametrize(("code", "reason"), [(Code.UNAVAILABLE, None), (Code.FAILED_PRECONDITION, "lease")])
def test_a_lost_target_fails_every_open_request_and_is_taken_back(code: grpc.StatusCode, reason: str | None) -> None:
    async def test(h: Harness) -> None:
        h.run_loop()
        requests = [h.submit(seq_id, max_tokens=500) for seq_id in range(1, 5)]
        await h.until(lambda: all(len(r.output_ids) >= 3 for r in requests))
        h.target.fail("Verify", code, reason=reason)
        await h.until(lambda: all(r.finished for r in requests))
        for request in requests:
            got = h.received(request)
            assert isinstance(got.error, Unavailable)
            assert got.tokens == expected(request)[: len(got.tokens)]
        await h.until(lambda: not h.workers.failover.target_lost)
        assert h.target.epoch == 2  # a new lease: what the lost target held is gone
        assert h.workers.failover.refusal() is None
        after = h.submit(9, max_tokens=10)
        await h.until(lambda: after.finished)
        assert_lossless(h, [after])
        await h.until(lambda: not h.target.sequences and not h.draft.sequences)

    run(test)


def test_a_channel_that_cannot_be_set_up_fails_the_start_in_one_line_within_its_bound() -> None:
    """A rendezvous that never completes (the target's SetupChannel hangs): the start fails after the bound and its
    share of slack, naming the channel, both workers and the flags to change, never hangs."""

    async def start() -> None:
        log = CallLog()
        target, draft = FakeTarget(log), FakeDraft(log)
        target.hang("SetupChannel")
        workers = Workers(
            "fake-target:1", "fake-draft:1", step_streams=False, channel_setup_timeout=0.2, stubs=(target, draft)
        )
        try:
            await workers.pair.connect()
            await workers.pair.set_up(Layout(8, 2, 3, (3,)))
        finally:
            await workers.close()

    began = time.monotonic()
    with pytest.raises(ModelLoadError) as failed:
        asyncio.run(start())
    assert time.monotonic() - began < 2.0
    message = str(failed.value)
    assert "\n" not in message
    assert message.startswith("the grpc channel between the target at fake-target:1 and the draft at fake-draft:1")
    assert "no answer within 0.4 s" in message and "--channel" in message and "--channel-setup-timeout" in message


def test_a_failed_precondition_for_the_model_fails_the_batch_not_the_target() -> None:
    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, max_tokens=30) for seq_id in range(1, 5)]
        await h.step_until(lambda: all(len(r.output_ids) >= 3 for r in requests))
        h.target.fail("Verify", Code.FAILED_PRECONDITION, reason="model")
        await h.finish(requests)
        failed = {s for c in h.log.of("target", "Verify") if c.error is not None for s in c.request.seq_ids}
        assert 0 < len(failed) < len(requests)
        for request in requests:
            if request.seq_id in failed:
                error = h.received(request).error
                assert isinstance(error, grpc.aio.AioRpcError) and error.code() == Code.FAILED_PRECONDITION
            else:
                assert_lossless(h, [request])
        assert not h.workers.failover.target_lost and h.target.epoch == 1
        after = h.submit(9)
        await h.finish([after])
        assert_lossless(h, [after])
        await assert_all_released(h)

    run(test)


@pytest.mark.parametrize("overlap", ["always", "never"])
def test_overlap_verifies_one_batch_while_the_other_is_drafted(overlap: str) -> None:
    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, max_tokens=20) for seq_id in range(1, 5)]
        await h.finish(requests)
        verifies, proposals = h.log.of("target", "Verify"), h.log.of("draft", "Propose")
        together = [(v, p) for v in verifies for p in proposals if v.overlaps(p)]
        if overlap == "always":
            assert len(together) >= len(verifies) // 2
            assert all(v.request.batch_id != p.request.batch_id for v, p in together)
        else:
            assert not together
        assert_lossless(h, requests)

    run(test, overlap=overlap, target={"latency": 0.002}, draft={"latency": 0.002, "wrong_every": 4})


@pytest.mark.parametrize(
    ("mode", "overlap", "hidden"), [("sd", "auto", False), ("psd", "never", False), ("psd", "always", True)]
)
def test_tetris_auto_drafts_extra_only_where_a_verify_hides_them(mode: str, overlap: str, hidden: bool) -> None:
    """`--tetris-extra-proposals auto` drafts extras only beside the other batch's verify (psd overlapping): in sd,
    or psd in turn, each extra draft would add its time to the step."""

    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, max_tokens=12) for seq_id in range(1, 5)]
        await h.finish(requests)
        drafted = {c.request.num_draft_tokens for c in h.log.of("draft", "Propose")}
        assert (max(drafted) > 3) == hidden, drafted
        assert_lossless(h, requests)

    run(test, mode=mode, overlap=overlap, tetris=True, extra_proposals="auto", draft={"latency": 0.001})


@pytest.mark.parametrize(
    ("speculation", "seeded", "always_drafted"), [("always", False, True), ("auto", False, False), ("auto", True, True)]
)
def test_speculation_policy_drafts_while_it_pays_or_a_seeded_request_runs(
    speculation: str, seeded: bool, always_drafted: bool
) -> None:
    """Every draft is wrong and the draft slow: auto soon decodes with the target alone (trying drafts again later,
    with the missed tokens); always, or a seeded request, drafts every step."""

    async def test(h: Harness) -> None:
        # (auto turns after 36 steps of a token each, and tries drafts again 128 steps later)
        request = h.submit(1, max_tokens=50 if always_drafted else 200, seeded=seeded)
        await h.finish([request])
        drafted = [c.request.num_draft_tokens for c in h.log.of("target", "Verify")]
        assert all(drafted) == always_drafted
        if not always_drafted:  # it turned to the target alone, then tried drafts again
            first_alone = drafted.index(0)
            assert 0 in drafted and 3 in drafted[first_alone:]
        assert_lossless(h, [request])

    run(test, mode="sd", speculation=speculation, draft={"latency": 0.003, "wrong_every": 1})


def test_a_drain_refuses_new_requests_and_finishes_the_admitted() -> None:
    async def test(h: Harness) -> None:
        requests = [h.submit(seq_id, max_tokens=20) for seq_id in range(1, 4)]
        await h.step_until(lambda: all(r.output_ids for r in requests))
        failover = h.workers.failover
        assert failover.refusal() is None and failover.health.serving()
        await failover.drain()
        refusal = failover.refusal()
        assert refusal is not None and refusal.reason == "draining"
        assert not failover.health.serving()
        await h.finish(requests)
        assert_lossless(h, requests)

    run(test)


def test_an_error_inside_a_step_fails_its_batches_and_the_loop_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    async def test(h: Harness) -> None:
        h.run_loop()
        requests = [h.submit(seq_id, max_tokens=500) for seq_id in range(1, 5)]
        await h.until(lambda: all(len(r.output_ids) >= 3 for r in requests))

        def broken(batch: Batch) -> None:
            monkeypatch.undo()  # once
            raise RuntimeError("a fault of the coordinator's")

        monkeypatch.setattr(h.manager, "rebalance", broken)
        await h.until(lambda: all(r.finished for r in requests))
        for request in requests:
            got = h.received(request)
            assert isinstance(got.error, RuntimeError) and "internal error" in str(got.error)
            assert got.tokens == expected(request)[: len(got.tokens)]
        after = h.submit(9, max_tokens=10)
        await h.until(lambda: after.finished)
        assert_lossless(h, [after])
        await h.until(lambda: not h.target.sequences and not h.draft.sequences)

    run(test, target={"latency": 0.002})  # (every proposal has answered when the verify's step fails)


def test_a_proposal_in_flight_when_a_step_fails_is_dropped_with_its_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """`asyncio.gather` in `StepLoop._step` leaves the other batch's Propose running when the verify raises; once it
    answers, `_propose` marks the batch that `run` cleared meanwhile as drafted and sends its verify ahead: the old
    members' drafts verified for the requests admitted since, before the draft has them, which leaves the draft a
    token behind on each of them for good (the output stays lossless; their drafts are all wrong)."""

    async def test(h: Harness) -> None:
        h.run_loop()
        requests = [h.submit(seq_id, max_tokens=500) for seq_id in range(1, 5)]
        await h.until(lambda: all(len(r.output_ids) >= 3 for r in requests))
        after: list[RequestState] = []

        def broken(batch: Batch) -> None:
            monkeypatch.undo()  # once
            after.extend(h.submit(seq_id, max_tokens=10) for seq_id in range(9, 13))  # admitted at the next step
            raise RuntimeError("a fault of the coordinator's")

        monkeypatch.setattr(h.manager, "rebalance", broken)
        await h.until(lambda: bool(after) and all(r.finished for r in requests + after))
        assert_lossless(h, after)
        assert not h.problems(), h.problems()  # the draft was fed tokens a position off

    run(test, draft={"latency": 0.005})


def test_the_fakes_fail_calls_as_grpc_does() -> None:
    error = rpc_error(Code.FAILED_PRECONDITION, "gone", reason="lease")
    assert error.code() == Code.FAILED_PRECONDITION and error.details() == "gone"
    assert ("minedraft-reason", "lease") in list(error.trailing_metadata() or ())


def _three_under_a_policy_drafting_one_step_in(every: int) -> Callable[[Harness], Coroutine[Any, Any, None]]:
    """A test: three requests of 40 tokens, the speculation policy's draft length forced to 0 (the target alone) at
    one step in `every`, preempted by a small pool, each ending with the fake target's own tokens."""

    async def test(h: Harness) -> None:
        steps = itertools.count()
        policy = h.loop.speculation_policy
        drafted = policy.choose
        policy.choose = lambda sequences: drafted(sequences) if next(steps) % every else 0  # type: ignore[method-assign]
        requests = [h.submit(seq_id, prompt_len=8, max_tokens=40) for seq_id in range(1, 4)]
        await h.finish(requests)
        assert h.loop.admission.preemptions >= 1
        assert_lossless(h, requests)
        await assert_all_released(h)

    return test


def test_preemption_at_a_step_of_the_target_alone_spares_a_batch_whose_verify_is_in_flight() -> None:
    """PSD sends a batch's verify as soon as its drafts are back; a step the policy gives to the target alone that
    runs short of blocks must not preempt that batch's members under the verify (its reply would not match)."""
    run(_three_under_a_policy_drafting_one_step_in(3), target={"num_blocks": 20})


@pytest.mark.parametrize("mode", MODES)
def test_a_request_its_first_token_ends_is_never_stepped(mode: str) -> None:
    """A request whose first token is its last leaves before the step's calls (the fakes fail a test whose worker
    steps a finished sequence)."""

    async def test(h: Harness) -> None:
        ones = [h.submit(seq_id, max_tokens=1) for seq_id in range(1, 4)]
        await h.finish(ones)
        await h.step_until(lambda: not h.loop.has_work())
        assert not h.log.of("target", "Verify") and not h.log.of("draft", "Propose")
        assert_lossless(h, ones)
        await assert_all_released(h)

    run(test, mode=mode)


def test_a_preempted_request_prefilled_again_to_its_last_token_is_never_stepped() -> None:
    prefills: list[Call] = []
    test = _three_under_a_policy_drafting_one_step_in(2)

    async def recorded(h: Harness) -> None:
        await test(h)
        prefills.extend(h.log.of("target", "Prefill"))

    run(recorded, target={"num_blocks": 20})
    assert any(s.output_tokens == 39 for c in prefills for s in c.request.sequences)  # (the case under test ran)
