"""Prometheus metrics: the counters' arithmetic, /metrics over HTTP, and a real stack's counters against usage."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

pytest.register_assert_rewrite("stack", "observed_stack")

from observed_stack import MAX_BATCH, K, ObservedRun  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from coordinator.request_state import RequestState  # noqa: E402
from minedraft.engine.sampling import SamplingConfig  # noqa: E402
from minedraft.observability.metrics import CoordinatorMetrics, WorkerMetrics, start_metrics_server  # noqa: E402
from minedraft.proto import common_pb2, generation_pb2, target_pb2  # noqa: E402
from minedraft_app.stack import free_port  # noqa: E402

pytest_plugins = ["stack", "observed_stack"]


def _results(accepted: list[int], emitted: list[int]) -> list[target_pb2.SequenceResult]:
    return [
        target_pb2.SequenceResult(seq_id=i, token_ids=[5] * n, num_accepted=a)
        for i, (a, n) in enumerate(zip(accepted, emitted))
    ]


def _request(seq_id: int = 1) -> RequestState:
    return RequestState(seq_id, [1, 2, 3], SamplingConfig(max_tokens=64, ignore_eos=True), (), None)


# --------------------------------------------------------------------------------------------- arithmetic


def test_usage_acceptance_figures() -> None:
    """Usage of a request verified three times at k=3 (accepting 3, 0 and 1 drafts)."""
    state = _request()
    state.emit([7], generation_pb2.FINISH_REASON_UNSPECIFIED)  # prefill
    for accepted in (3, 0, 1):
        state.record_verify(3, accepted, accepted + 1)
        state.emit([7] * (accepted + 1), generation_pb2.FINISH_REASON_UNSPECIFIED)
    state.finish(generation_pb2.FINISH_REASON_CANCELLED)
    messages = [state.client.queue.get_nowait() for _ in range(state.client.queue.qsize())]
    assert all(isinstance(m, generation_pb2.GenerateResponse) for m in messages)
    assert [m.HasField("usage") for m in messages] == [False] * 4 + [True]  # type: ignore[union-attr]
    usage = messages[-1].usage  # type: ignore[union-attr]
    assert (usage.prompt_tokens, usage.completion_tokens, usage.steps) == (3, 8, 3)
    assert (usage.draft_tokens, usage.accepted_tokens) == (9, 4)
    assert usage.mean_accepted_length == pytest.approx(4 / 3 + 1)  # accepted per step + the target's own token
    assert usage.drafted_steps == 3
    assert usage.acceptance_rate == pytest.approx(4 / 9)
    assert list(usage.accepted_per_position) == [2, 1, 1]
    assert usage.time_to_first_token_s >= 0 and usage.time_per_output_token_s >= 0


def test_verify_counters_match_record_verify() -> None:
    """CoordinatorMetrics.verified adds what RequestState.record_verify adds to each request's usage."""
    metrics = CoordinatorMetrics()
    states = [_request(i) for i in range(4)]
    # The last row: a budget cut, 3 drafts accepted, 2 emitted (both counted, the third not: it was never sent)
    steps = [([3, 0, 1, 2], [4, 1, 2, 3]), ([0, 3, 3, 1], [1, 4, 2, 2])]
    for accepted, emitted in steps:
        results = _results(accepted, emitted)
        for state, result in zip(states, results):
            state.record_verify(K, result.num_accepted, len(result.token_ids))
            state.decode.output_ids += list(result.token_ids)
        metrics.verified(results, K)
    metrics.verified(_results([0, 0], [1, 1]), 0)  # target-only decoding: tokens, no drafts
    value = metrics.registry.get_sample_value
    usages = [s.usage() for s in states]
    assert value("minedraft_generation_tokens_total") == sum(u.completion_tokens for u in usages) + 2
    assert value("minedraft_draft_tokens_total") == sum(u.draft_tokens for u in usages) == 2 * 4 * K
    assert value("minedraft_accepted_tokens_total") == sum(u.accepted_tokens for u in usages) == 12
    for position in range(K):
        assert value("minedraft_accepted_tokens_by_position_total", {"position": str(position)}) == sum(
            u.accepted_per_position[position] for u in usages
        )
    assert value("minedraft_verified_sequences_total") == sum(u.steps for u in usages) == 8
    assert value("minedraft_verify_steps_total") == 2


def test_overlap_efficiency() -> None:
    metrics = CoordinatorMetrics()
    metrics.worker_call("verify", 4, 10.0, 10.3)
    metrics.worker_call("propose", 4, 10.0, 10.2)
    metrics.overlapped_step(10.0, 10.4)
    value = metrics.registry.get_sample_value
    assert value("minedraft_overlap_efficiency_sum") == pytest.approx(0.3 / 0.4)
    assert value("minedraft_overlapped_step_seconds_sum") == pytest.approx(0.4)
    assert value("minedraft_step_seconds_count", {"kind": "verify"}) == 1
    assert value("minedraft_batch_size_sum", {"kind": "propose"}) == 4
    metrics.worker_call("verify", 4, 11.0, 11.3)  # the propose of this step failed: its timing is stale
    metrics.overlapped_step(11.0, 11.4)
    assert value("minedraft_overlap_efficiency_count") == 1


def test_request_end_and_gauges() -> None:
    metrics = CoordinatorMetrics()
    waiting = [3]
    metrics.track_state(lambda: waiting[0], lambda: 5, lambda: 0.0, lambda: 2, lambda: 0.0, lambda: 2.0)
    usage = generation_pb2.Usage(
        completion_tokens=10,
        draft_tokens=12,
        accepted_tokens=6,
        steps=4,
        mean_accepted_length=2.5,
        acceptance_rate=0.5,
        time_to_first_token_s=0.2,
        time_per_output_token_s=0.01,
    )
    metrics.request_finished("length", usage, 1.5)
    metrics.request_finished("cancelled", None, 0.5)
    metrics.request_rejected("queue_full")
    value = metrics.registry.get_sample_value
    assert value("minedraft_requests_total", {"finish_reason": "length"}) == 1
    assert value("minedraft_requests_total", {"finish_reason": "cancelled"}) == 1
    assert value("minedraft_requests_rejected_total", {"reason": "queue_full"}) == 1
    assert value("minedraft_time_to_first_token_seconds_sum") == pytest.approx(0.2)
    assert value("minedraft_time_per_output_token_seconds_sum") == pytest.approx(0.01)
    assert value("minedraft_request_mean_accepted_length_sum") == pytest.approx(2.5)
    assert value("minedraft_request_duration_seconds_count") == 2
    assert value("minedraft_queue_length") == 3 and value("minedraft_running_sequences") == 5
    assert value("minedraft_draft_connected") == 0 and value("minedraft_batches") == 2
    assert value("minedraft_drafting") == 0
    assert value("minedraft_draft_length") == 2
    waiting[0] = 0
    assert value("minedraft_queue_length") == 0


def test_worker_metrics_from_messages() -> None:
    metrics = WorkerMetrics()
    timings = common_pb2.Timings(compute_s=0.02, channel_s=0.001, queue_s=0.004)
    verify = target_pb2.VerifyRequest(step_id=3, batch_id=1, seq_ids=[1, 2], num_draft_tokens=4)
    reply = target_pb2.VerifyResponse(results=_results([4, 1], [5, 2]), timings=timings)
    metrics.observe_call("Verify", verify, reply, 0.03, grpc.StatusCode.OK)
    metrics.observe_call(
        "Release",
        target_pb2.TargetServiceReleaseRequest(seq_ids=[1]),
        target_pb2.TargetServiceReleaseResponse(free_slots=15),
        0.001,
        grpc.StatusCode.OK,
    )
    metrics.observe_call("Verify", verify, None, 0.001, grpc.StatusCode.NOT_FOUND)
    value = metrics.registry.get_sample_value
    assert value("minedraft_worker_rpcs_total", {"method": "Verify", "code": "OK"}) == 1
    assert value("minedraft_worker_rpcs_total", {"method": "Verify", "code": "NOT_FOUND"}) == 1
    assert value("minedraft_worker_draft_tokens_total") == 8
    assert value("minedraft_worker_accepted_tokens_total") == 5
    assert value("minedraft_worker_tokens_total") == 7
    assert value("minedraft_worker_batch_size_sum", {"method": "Verify"}) == 2
    assert value("minedraft_worker_compute_seconds_sum", {"method": "Verify"}) == pytest.approx(0.02)
    assert value("minedraft_worker_channel_seconds_sum", {"method": "Verify"}) == pytest.approx(0.001)
    assert value("minedraft_worker_queue_seconds_sum", {"method": "Verify"}) == pytest.approx(0.004)


def test_metrics_served_over_http() -> None:
    assert start_metrics_server(0, "127.0.0.1", CollectorRegistry()) == 0  # port 0: off
    metrics = CoordinatorMetrics()
    metrics.request_finished("stop", None, 0.1)
    port = start_metrics_server(free_port(), "[127.0.0.1]", metrics.registry)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert 'minedraft_requests_total{finish_reason="stop"} 1.0' in text


# --------------------------------------------------------------------------------------------- the stack


def test_coordinator_counters_agree_with_usage(observed_run: ObservedRun) -> None:
    run, usages = observed_run, observed_run.usages
    assert run.exit_codes == {"coordinator": 0, "target": 0, "draft": 0}, run.logs
    assert [u.completion_tokens for u in usages] == [len(ids) for ids in run.token_ids] == [14, 12]
    assert sum(u.accepted_tokens for u in usages) > 0  # the gpt2 pair accepts some drafts: a real comparison

    def m(name: str, **labels: str) -> float:
        return run.metric("coordinator", name, **labels)

    assert m("minedraft_requests_total", finish_reason="length") == 2
    assert m("minedraft_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert m("minedraft_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert m("minedraft_draft_tokens_total") == sum(u.draft_tokens for u in usages)
    assert m("minedraft_accepted_tokens_total") == sum(u.accepted_tokens for u in usages)
    assert m("minedraft_verified_sequences_total") == sum(u.steps for u in usages)
    for position in range(K):
        assert m("minedraft_accepted_tokens_by_position_total", position=str(position)) == sum(
            u.accepted_per_position[position] for u in usages if len(u.accepted_per_position) > position
        )
    assert m("minedraft_request_mean_accepted_length_sum") == pytest.approx(sum(u.mean_accepted_length for u in usages))
    assert m("minedraft_request_acceptance_rate_sum") == pytest.approx(sum(u.acceptance_rate for u in usages))
    assert m("minedraft_time_to_first_token_seconds_count") == 2
    assert m("minedraft_time_to_first_token_seconds_sum") == pytest.approx(sum(u.time_to_first_token_s for u in usages))
    assert m("minedraft_time_per_output_token_seconds_sum") == pytest.approx(
        sum(u.time_per_output_token_s for u in usages)
    )
    assert m("minedraft_queue_length") == 0 and m("minedraft_running_sequences") == 0
    assert m("minedraft_draft_connected") == 1 and m("minedraft_batches") == 2  # psd on CPUs: no GPU shared


def test_step_metrics(observed_run: ObservedRun) -> None:
    run = observed_run

    def m(name: str, **labels: str) -> float:
        return run.metric("coordinator", name, **labels)

    verifies = m("minedraft_step_seconds_count", kind="verify")
    assert (
        verifies
        == m("minedraft_step_seconds_count", kind="propose")
        == m("minedraft_batch_size_count", kind="verify")
        > 0
    )
    assert m("minedraft_verify_steps_total") == verifies
    overlapped = m("minedraft_overlap_efficiency_count")
    assert overlapped > 0  # two requests in two batches: PSD steps ran
    assert 0 < m("minedraft_overlap_efficiency_sum") / overlapped <= 1
    assert m("minedraft_overlapped_step_seconds_count") == overlapped


def test_worker_counters_agree_with_usage(observed_run: ObservedRun) -> None:
    run, usages = observed_run, observed_run.usages
    drafts = sum(u.draft_tokens for u in usages)
    assert run.metric("target", "minedraft_worker_draft_tokens_total") == drafts
    assert run.metric("target", "minedraft_worker_accepted_tokens_total") == sum(u.accepted_tokens for u in usages)
    assert run.metric("target", "minedraft_worker_tokens_total") == sum(u.completion_tokens for u in usages)
    assert run.metric("draft", "minedraft_worker_draft_tokens_total") == drafts  # every proposal was verified
    verifies = run.metric("coordinator", "minedraft_step_seconds_count", kind="verify")
    assert run.metric("target", "minedraft_worker_rpcs_total", method="Verify", code="OK") == verifies
    assert run.metric("draft", "minedraft_worker_rpcs_total", method="Propose", code="OK") == verifies
    for service in ("target", "draft"):
        assert run.metric(service, "minedraft_worker_free_slots") == 2 * MAX_BATCH  # all released
        assert run.metric(service, "minedraft_worker_compute_seconds_count", method="Prefill") >= 1
