"""Tracing: set-up from the OTEL_* variables, context across gRPC, and one request traced through all services."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry is optional; without it tracing is a no-op")
pytest.register_assert_rewrite("stack", "observed_stack")

from observed_stack import CLIENT_SPAN_ID, CLIENT_TRACE_ID, ObservedRun, ReceivedSpan  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from coordinator.main import Coordinator  # noqa: E402
from coordinator.options import CoordinatorOptions  # noqa: E402
from coordinator.tracing import SpanTracing, StepTracing  # noqa: E402
from coordinator.workers import Workers  # noqa: E402
from minedraft.errors import InvalidRequest  # noqa: E402
from minedraft.observability import telemetry  # noqa: E402
from minedraft.proto import target_pb2  # noqa: E402
from minedraft.rpc.step_stream import serve_step_stream  # noqa: E402

pytest_plugins = ["stack", "observed_stack"]

REPO = Path(__file__).resolve().parents[1]
OTEL_VARIABLES = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
)


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def memory_tracing() -> Iterator[tuple[telemetry.Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    tracing = telemetry.setup_tracing("minedraft-test", exporter=exporter)
    yield tracing, exporter
    tracing.shutdown()


# --------------------------------------------------------------------------------------------- set-up


def test_off_without_endpoint() -> None:
    tracing = telemetry.setup_tracing("minedraft-target")
    assert not tracing.enabled and tracing.tracer is None
    assert telemetry.server_interceptors(tracing) == []
    assert telemetry.inject_metadata() == []  # no current span: nothing to send
    tracing.shutdown()  # a no-op


@pytest.mark.parametrize("variable,value", [("OTEL_SDK_DISABLED", "true"), ("OTEL_TRACES_EXPORTER", "none")])
def test_off_when_disabled(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv(variable, value)
    assert not telemetry.setup_tracing("minedraft-target").enabled


def test_endpoint_turns_on_otlp_exporter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    tracing = telemetry.setup_tracing("minedraft-draft")
    try:
        assert tracing.enabled and tracing.service_name == "minedraft-draft"
        assert isinstance(telemetry.server_interceptors(tracing)[0], telemetry.ServerObserver)
    finally:
        tracing.provider.force_flush(100)  # nothing was recorded: no export is attempted
        tracing.shutdown()


def test_service_name_default_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    tracing = telemetry.setup_tracing("minedraft-coordinator", exporter=InMemorySpanExporter())
    assert tracing.service_name == "minedraft-coordinator"
    tracing.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-coordinator")
    tracing = telemetry.setup_tracing("minedraft-coordinator", exporter=InMemorySpanExporter())
    assert tracing.service_name == "my-coordinator"
    tracing.shutdown()
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attributes,deployment.environment=test")
    tracing = telemetry.setup_tracing("minedraft-coordinator", exporter=InMemorySpanExporter())
    assert tracing.service_name == "from-attributes"
    assert tracing.provider.resource.attributes["deployment.environment"] == "test"
    tracing.shutdown()


def test_sampler_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    exporter = InMemorySpanExporter()
    tracing = telemetry.setup_tracing("minedraft-test", exporter=exporter)
    assert tracing.tracer is not None
    with tracing.tracer.start_as_current_span("dropped"):
        pass
    tracing.provider.force_flush()
    assert exporter.get_finished_spans() == ()
    tracing.shutdown()


def test_services_run_without_opentelemetry() -> None:
    """With opentelemetry absent (as on the GPU machines) every module imports and tracing is a no-op."""
    script = """
import sys
sys.modules["opentelemetry"] = None  # any `import opentelemetry...` now fails
import coordinator.main, draft_service.server, minedraft_app.cli, target_service.server
from minedraft.observability import telemetry
assert not telemetry.HAVE_OTEL
tracing = telemetry.setup_tracing("minedraft-target")
assert not tracing.enabled
assert telemetry.server_interceptors(tracing) == [] and telemetry.inject_metadata() == []
tracing.shutdown()
print("ok")
"""
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
    assert "opentelemetry is not installed" in result.stderr


def test_step_loop_is_plain_when_tracing_is_off(memory_tracing: tuple[telemetry.Tracing, Any]) -> None:
    async def build(tracing: telemetry.Tracing | None) -> Coordinator:
        coordinator = Coordinator(CoordinatorOptions(target="127.0.0.1:9", draft="127.0.0.1:9"), tracing)
        await coordinator.workers.close()
        return coordinator

    plain = asyncio.run(build(telemetry.setup_tracing("minedraft-coordinator")))
    assert type(plain.workers.tracing) is StepTracing and plain.front_door.tracer is None
    traced = asyncio.run(build(memory_tracing[0]))
    assert isinstance(traced.workers.tracing, SpanTracing) and traced.front_door.tracer is not None


# --------------------------------------------------------------------------------------------- over gRPC


async def _call_through_observer(tracing: telemetry.Tracing, fail: bool, calls: list[tuple[Any, ...]]) -> Any:
    """A worker-like server behind ServerObserver, called by a client that injects the context in a batch span."""

    async def release(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if fail:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such sequence")
        return target_pb2.TargetServiceReleaseResponse(free_slots=7)

    handler = grpc.method_handlers_generic_handler(
        "minedraft.test.Worker",
        {
            "Release": grpc.unary_unary_rpc_method_handler(
                release,
                request_deserializer=target_pb2.TargetServiceReleaseRequest.FromString,
                response_serializer=target_pb2.TargetServiceReleaseResponse.SerializeToString,
            ),
        },
    )
    observer = telemetry.server_interceptors(tracing, lambda *args: calls.append(args))
    server = grpc.aio.server(interceptors=observer)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    assert tracing.tracer is not None
    request_span = tracing.tracer.start_span("request")
    try:
        async with grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", interceptors=[telemetry.TraceContextInjector()]
        ) as channel:
            call = channel.unary_unary(
                "/minedraft.test.Worker/Release",
                request_serializer=target_pb2.TargetServiceReleaseRequest.SerializeToString,
                response_deserializer=target_pb2.TargetServiceReleaseResponse.FromString,
            )
            links = telemetry.links_to([request_span, None])
            with telemetry.batch_span(tracing.tracer, "release", links, {"minedraft.batch_size": 3}):
                try:
                    return await call(target_pb2.TargetServiceReleaseRequest(seq_ids=[1, 2, 3]))
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
    finally:
        request_span.end()
        await server.stop(None)


def test_context_crosses_grpc(memory_tracing: tuple[telemetry.Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory_tracing
    calls: list[tuple[Any, ...]] = []
    reply = asyncio.run(_call_through_observer(tracing, False, calls))
    assert reply.free_slots == 7
    tracing.provider.force_flush()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    client, server, request = spans["release"], spans["minedraft.test.Worker/Release"], spans["request"]
    assert client.kind == trace.SpanKind.CLIENT and server.kind == trace.SpanKind.SERVER
    assert server.context.trace_id == client.context.trace_id
    assert server.parent is not None and server.parent.span_id == client.context.span_id
    assert [link.context.span_id for link in client.links] == [request.context.span_id]
    attributes = dict(server.attributes or {})
    assert attributes["minedraft.batch_size"] == 3
    assert attributes["rpc.method"] == "Release" and attributes["rpc.grpc.status_code"] == 0
    assert server.status.is_ok
    method, request_message, response, seconds, code = calls[0]
    assert (method, list(request_message.seq_ids), response.free_slots, code) == (
        "Release",
        [1, 2, 3],
        7,
        grpc.StatusCode.OK,
    )
    assert seconds >= 0


def test_failed_call_is_an_error_span(memory_tracing: tuple[telemetry.Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = memory_tracing
    calls: list[tuple[Any, ...]] = []
    assert asyncio.run(_call_through_observer(tracing, True, calls)) == grpc.StatusCode.NOT_FOUND
    tracing.provider.force_flush()
    server = next(s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER)
    assert not server.status.is_ok
    assert dict(server.attributes or {})["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
    assert calls[0][2] is None and calls[0][4] == grpc.StatusCode.NOT_FOUND


def test_each_message_of_a_step_stream_is_observed_as_its_call(
    memory_tracing: tuple[telemetry.Tracing, InMemorySpanExporter],
) -> None:
    """A VerifyStream's messages: a SERVER span each, named and parented as a unary Verify's would be (from the
    message's trace context), and the worker's metrics told of each with its own status."""
    tracing, exporter = memory_tracing
    calls: list[tuple[Any, ...]] = []

    async def verify(request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        if request.batch_id > 1:
            raise InvalidRequest("batch_id must be 0 or 1")
        return target_pb2.VerifyResponse(results=[target_pb2.SequenceResult(seq_id=s) for s in request.seq_ids])

    async def verify_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for reply in serve_step_stream(requests, verify, target_pb2.VerifyStreamResponse):
            yield reply

    async def main() -> list[Any]:
        handler = grpc.method_handlers_generic_handler(
            "minedraft.v1.TargetService",
            {
                "VerifyStream": grpc.stream_stream_rpc_method_handler(
                    verify_stream,
                    request_deserializer=target_pb2.VerifyStreamRequest.FromString,
                    response_serializer=target_pb2.VerifyStreamResponse.SerializeToString,
                )
            },
        )
        server = grpc.aio.server(interceptors=telemetry.server_interceptors(tracing, lambda *a: calls.append(a)))
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        assert tracing.tracer is not None
        workers = Workers(f"127.0.0.1:{port}", None, tracing=SpanTracing(tracing.tracer))
        try:
            stream = workers.target.stream
            assert stream is not None
            outcomes: list[list[int] | grpc.StatusCode] = []
            for batch_id in (0, 5):
                with telemetry.batch_span(tracing.tracer, "verify", [], {}):
                    try:
                        reply = await stream.call(
                            target_pb2.VerifyRequest(batch_id=batch_id, seq_ids=[4, 5]),
                            10,
                            workers.tracing.trace_context(),
                        )
                        outcomes.append([r.seq_id for r in reply.results])
                    except grpc.aio.AioRpcError as exc:
                        outcomes.append(exc.code())
            return outcomes
        finally:
            await workers.close()
            await server.stop(None)

    assert asyncio.run(main()) == [[4, 5], grpc.StatusCode.INVALID_ARGUMENT]
    tracing.provider.force_flush()
    spans = exporter.get_finished_spans()
    clients = [s for s in spans if s.name == "verify"]
    servers = [s for s in spans if s.name == "minedraft.v1.TargetService/Verify"]
    assert len(servers) == 2 and all(s.kind == trace.SpanKind.SERVER for s in servers)
    for client, server in zip(clients, servers, strict=True):
        assert server.parent is not None and server.parent.span_id == client.context.span_id
        assert dict(server.attributes or {})["minedraft.batch_size"] == 2
    assert servers[0].status.is_ok and not servers[1].status.is_ok
    assert [(c[0], c[4]) for c in calls] == [
        ("Verify", grpc.StatusCode.OK),
        ("Verify", grpc.StatusCode.INVALID_ARGUMENT),
    ]
    assert calls[0][2] is not None and calls[1][2] is None


# --------------------------------------------------------------------------------------------- the stack


def _traced(run: ObservedRun) -> ObservedRun:
    if not run.traced:
        pytest.skip("opentelemetry-proto is not installed: no OTLP receiver")
    return run


def test_every_service_exports_and_exits_cleanly(observed_run: ObservedRun) -> None:
    run = _traced(observed_run)
    assert run.exit_codes == {"coordinator": 0, "target": 0, "draft": 0}, run.logs
    assert {s.service for s in run.spans} == {"minedraft-coordinator", "minedraft-target", "minedraft-draft"}


def _request_spans(run: ObservedRun) -> list[ReceivedSpan]:
    """The two request spans in the order of run.usages: the first request sent a traceparent."""
    spans = [s for s in run.spans if s.name == telemetry.GENERATE_SPAN]
    assert len(spans) == len(run.usages) == 2
    return sorted(spans, key=lambda s: s.trace_id != CLIENT_TRACE_ID)


def test_request_span_continues_client_trace_and_carries_usage(observed_run: ObservedRun) -> None:
    run = _traced(observed_run)
    first, second = _request_spans(run)
    assert (first.trace_id, first.parent_span_id) == (CLIENT_TRACE_ID, CLIENT_SPAN_ID)
    assert second.trace_id != CLIENT_TRACE_ID and second.parent_span_id == ""  # no traceparent: a new trace
    for span, usage in zip((first, second), run.usages):
        assert span.service == "minedraft-coordinator"
        assert span.attributes["minedraft.finish_reason"] == "length"
        assert span.attributes["minedraft.usage.completion_tokens"] == usage.completion_tokens
        assert span.attributes["minedraft.usage.accepted_tokens"] == usage.accepted_tokens
        assert span.attributes["minedraft.usage.accepted_per_position"] == list(usage.accepted_per_position)


def test_request_trace_reaches_every_service(observed_run: ObservedRun) -> None:
    """From each request span, through the step calls that link to it and their children, to both workers."""
    run = _traced(observed_run)
    by_id = {(s.trace_id, s.span_id): s for s in run.spans}
    children: dict[tuple[str, str], list[ReceivedSpan]] = {}
    for span in run.spans:
        children.setdefault((span.trace_id, span.parent_span_id), []).append(span)
    for request, usage in zip(_request_spans(run), run.usages):
        linked = [s for s in run.spans if (request.trace_id, request.span_id) in s.links]
        assert {s.name for s in linked} == {"prefill", "propose", "verify", "release"}
        assert all(s.service == "minedraft-coordinator" and s.kind == 3 for s in linked)  # SPAN_KIND_CLIENT
        for kind in ("propose", "verify"):
            calls = [s for s in linked if s.name == kind]
            assert len(calls) == usage.steps  # one verify (and the propose before it) per step of the request
            for span in calls:
                assert {"minedraft.batch_id", "minedraft.step_id", "minedraft.batch_size"} <= span.attributes.keys()
                assert by_id[(span.trace_id, span.parent_span_id)].name == "step"
        reached = {request.service}
        served: set[str] = set()
        for span in linked:
            for child in children.get((span.trace_id, span.span_id), []):
                assert child.kind == 2  # SPAN_KIND_SERVER
                reached.add(child.service)
                served.add(child.name)
        assert reached == {"minedraft-coordinator", "minedraft-target", "minedraft-draft"}
        # (Releases ride on the next calls: the release span is the coordinator's alone.)
        assert {
            "minedraft.v1.TargetService/Prefill",
            "minedraft.v1.DraftService/Prefill",
            "minedraft.v1.DraftService/Propose",
            "minedraft.v1.TargetService/Verify",
        } <= served


def test_psd_step_overlaps_verify_and_propose(observed_run: ObservedRun) -> None:
    """A PSD verify of one batch runs while the other batch's propose does, each linked to its request. (A verify
    is sent ahead, from the step that drafted its batch: that step's trace holds it.)"""
    run = _traced(observed_run)
    verifies = [s for s in run.spans if s.name == "verify"]
    proposes = [s for s in run.spans if s.name == "propose"]
    overlapped = 0
    for verify in verifies:
        for propose in proposes:
            other = verify.attributes["minedraft.batch_id"] != propose.attributes["minedraft.batch_id"]
            if other and verify.start_ns < propose.end_ns and propose.start_ns < verify.end_ns:
                overlapped += 1
                assert verify.links and propose.links and verify.links != propose.links
    assert overlapped > 0
