"""OpenTelemetry tracing: OTLP set-up from the standard variables, W3C context over gRPC metadata, span helpers."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from minedraft.rpc.step_stream import call_field, status_code, step_call_of

# opentelemetry is optional (the GPU images do not ship it): without it every function here is a no-op.
try:
    from opentelemetry import propagate
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, Tracer

    HAVE_OTEL = True
except ImportError:  # pragma: no cover - exercised in a subprocess that hides the package
    HAVE_OTEL = False

log = logging.getLogger(__name__)

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
GENERATE_SPAN = "minedraft.v1.GenerationService/Generate"
# Called after every observed worker RPC: (method, request, response or None, seconds, status code).
CallObserver = Callable[[str, Any, Any, float, grpc.StatusCode], None]


class Tracing:
    """One service's tracer provider, or none. `tracer` is None when tracing is off: callers test that once, at
    construction, and then create no span objects at all."""

    def __init__(self, provider: Any = None) -> None:
        self.provider = provider
        self.tracer: Tracer | None = provider.get_tracer("minedraft") if provider is not None else None

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    @property
    def service_name(self) -> str:
        return str(self.provider.resource.attributes[SERVICE_NAME]) if self.provider is not None else ""

    def shutdown(self) -> None:
        """Export what is still queued, then stop (call once, at exit)."""
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None
            self.tracer = None


def setup_tracing(default_service_name: str, exporter: SpanExporter | None = None) -> Tracing:
    """A tracer provider configured by the standard OTEL_* variables, exporting over OTLP/gRPC.

    Off unless OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set or an exporter is given;
    also off with OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none, and when opentelemetry is not installed.
    service.name is `default_service_name` unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one. The
    sampler (OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG), the batch processor (OTEL_BSP_*) and the exporter
    (endpoint, headers, timeout, compression, insecure) read their own variables.
    """
    endpoint = next((os.environ[v] for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)
    if exporter is None and endpoint is None:
        return Tracing()
    if not HAVE_OTEL:
        log.warning("OTLP endpoint %s is set but opentelemetry is not installed: tracing is off", endpoint)
        return Tracing()
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Tracing()
    if exporter is None:
        kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
        if kind == "none":
            return Tracing()
        if kind != "otlp":
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported here; exporting over OTLP/gRPC", kind)
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("opentelemetry-exporter-otlp-proto-grpc is not installed: tracing is off")
            return Tracing()
        exporter = OTLPSpanExporter()
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    provider = TracerProvider(resource=resource)  # the sampler comes from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(exporter))
    tracing = Tracing(provider)
    log.info("tracing as %s to %s", tracing.service_name, endpoint or type(exporter).__name__)
    return tracing


def _carrier(metadata: Iterable[tuple[str, Any]] | None) -> dict[str, str]:
    """gRPC metadata as a propagation carrier (text values only; keys are lower case already)."""
    return {key: value for key, value in metadata or () if isinstance(value, str)}


def inject_metadata() -> list[tuple[str, str]]:
    """The current trace context (traceparent, tracestate, baggage) as gRPC metadata; empty without one."""
    if not HAVE_OTEL:
        return []
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


class TraceContextInjector(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the caller's trace context to every unary call's metadata (installed only when tracing is on).

    The interceptor runs in a task created when the stub is called, so it sees the caller's current span.
    """

    async def intercept_unary_unary(
        self, continuation: Callable[..., Awaitable[Any]], client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        extra = inject_metadata()
        if extra:
            metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()), *extra)
            client_call_details = client_call_details._replace(metadata=metadata)  # type: ignore[attr-defined]
        return await continuation(client_call_details, request)


def message_attributes(message: Any) -> dict[str, Any]:
    """The batch figures of a worker request or response, as span attributes (minedraft.*)."""
    attributes: dict[str, Any] = {}
    fields = message.DESCRIPTOR.fields_by_name
    for name in ("step_id", "batch_id", "num_draft_tokens"):
        if name in fields:
            attributes[f"minedraft.{name}"] = getattr(message, name)
    if "seq_ids" in fields:
        attributes["minedraft.batch_size"] = len(message.seq_ids)
    elif "sequences" in fields:
        attributes["minedraft.batch_size"] = len(message.sequences)
    if "timings" in fields and message.HasField("timings"):
        attributes["minedraft.compute_s"] = message.timings.compute_s
        attributes["minedraft.channel_s"] = message.timings.channel_s
        attributes["minedraft.queue_s"] = message.timings.queue_s
    if "results" in fields:
        attributes["minedraft.accepted_tokens"] = sum(r.num_accepted for r in message.results)
        attributes["minedraft.emitted_tokens"] = sum(len(r.token_ids) for r in message.results)
    return attributes


def _status_code(context: grpc.aio.ServicerContext, exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, grpc.aio.AbortError):
        try:
            return context.code() or grpc.StatusCode.UNKNOWN
        except NotImplementedError:
            return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.CANCELLED if isinstance(exc, asyncio.CancelledError) else grpc.StatusCode.UNKNOWN


class ServerObserver(grpc.aio.ServerInterceptor):
    """Around every unary call of a worker's own services (not grpc.health or reflection): a SERVER span whose
    parent comes from the caller's traceparent, and a call to `on_call` (the worker's metrics). Installed only
    when tracing or metrics are on."""

    def __init__(self, tracer: Tracer | None = None, on_call: CallObserver | None = None) -> None:
        self.tracer, self.on_call = tracer, on_call
        self._handlers: dict[str, Any] = {}  # full method name -> the observed handler, made once

    async def intercept_service(
        self, continuation: Callable[..., Awaitable[Any]], handler_call_details: grpc.HandlerCallDetails
    ) -> Any:
        full_method: str = handler_call_details.method  # "/package.Service/Method"
        observed = self._handlers.get(full_method)
        if observed is None:
            handler = await continuation(handler_call_details)
            if handler is None or full_method.startswith("/grpc."):
                return handler
            if handler.unary_unary is not None:
                observed = self._observe(full_method, handler)
            elif handler.stream_stream is not None and step_call_of(full_method.rpartition("/")[2]):
                observed = self._observe_step_stream(full_method, handler)
            else:
                return handler
            self._handlers[full_method] = observed
        return observed

    def _start_span(self, full_method: str, carrier: Mapping[str, str], request: Any) -> Span | None:
        if self.tracer is None:
            return None
        service, _, method = full_method[1:].rpartition("/")
        return self.tracer.start_span(
            full_method[1:],
            context=propagate.extract(dict(carrier)),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": service,
                "rpc.method": method,
                **message_attributes(request),
            },
        )

    def _observe(self, full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        inner: Any = handler.unary_unary  # a coroutine function here: grpc's stubs type the sync server's handlers
        method = full_method.rpartition("/")[2]

        async def observed(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code, response = grpc.StatusCode.OK, None
            span = self._start_span(full_method, _carrier(context.invocation_metadata()), request)
            try:
                response = await inner(request, context)
                return response
            except BaseException as exc:
                code = _status_code(context, exc)
                raise
            finally:
                seconds = time.perf_counter() - start
                if span is not None:
                    _end_rpc_span(span, code, response)
                if self.on_call is not None:
                    self.on_call(method, request, response, seconds, code)

        return grpc.unary_unary_rpc_method_handler(
            observed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _observe_step_stream(self, full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """Each message of a step stream observed as the unary call it stands for (a span named after that method,
        parented by the message's trace context; `on_call` with that method's name)."""
        inner: Any = handler.stream_stream  # an async generator function here (as above)
        service, _, stream_method = full_method[1:].rpartition("/")
        method = step_call_of(stream_method)
        call_method = f"/{service}/{method}"

        async def observed(envelopes: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started: collections.deque[tuple[float, Any, Span | None]] = collections.deque()

            async def requests() -> AsyncIterator[Any]:
                async for envelope in envelopes:
                    request = getattr(envelope, call_field(envelope))
                    started.append(
                        (time.perf_counter(), request, self._start_span(call_method, envelope.trace_context, request))
                    )
                    yield envelope

            try:
                async for reply in inner(requests(), context):
                    start, request, span = started.popleft()
                    code = status_code(reply.status.code)
                    response = getattr(reply, call_field(reply)) if code == grpc.StatusCode.OK else None
                    if span is not None:
                        _end_rpc_span(span, code, response)
                    if self.on_call is not None:
                        self.on_call(method, request, response, time.perf_counter() - start, code)
                    yield reply
            finally:
                for _, _, span in started:  # calls the stream ended before their replies
                    if span is not None:
                        _end_rpc_span(span, grpc.StatusCode.CANCELLED, None)

        return grpc.stream_stream_rpc_method_handler(
            observed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _end_rpc_span(span: Span, code: grpc.StatusCode, response: Any) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if response is not None:
        span.set_attributes(message_attributes(response))
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def server_interceptors(
    tracing: Tracing | None, on_call: CallObserver | None = None
) -> list[grpc.aio.ServerInterceptor]:
    """What a worker's gRPC server installs: nothing when tracing and metrics are both off."""
    tracer = tracing.tracer if tracing is not None else None
    return [ServerObserver(tracer, on_call)] if tracer is not None or on_call is not None else []


def start_request_span(
    tracer: Tracer,
    metadata: Iterable[tuple[str, Any]] | None,
    attributes: Mapping[str, Any],
    http_route: str | None = None,
) -> Span:
    """The request's SERVER span in the coordinator; continues the client's trace when it sent a traceparent (in its
    gRPC metadata, or its HTTP headers: both are lower-case key/value pairs). `http_route`: the HTTP API's route the
    request came by; None: the gRPC Generate.

    It is not made current (it outlives many awaits); the worker calls of each step link to it instead.
    """
    parent = propagate.extract(_carrier(metadata))
    if http_route is None:
        name = GENERATE_SPAN
        transport = {"rpc.system": "grpc", "rpc.service": "minedraft.v1.GenerationService", "rpc.method": "Generate"}
    else:
        name, transport = f"POST {http_route}", {"http.request.method": "POST", "http.route": http_route}
    return tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes={**transport, **attributes})


def end_request_span(span: Span, finish_reason: str, usage: Any = None, error: str | None = None) -> None:
    """Close the request span with its finish reason and, when the request got one, its usage."""
    span.set_attribute("minedraft.finish_reason", finish_reason)
    if usage is not None:
        for field in (
            "prompt_tokens",
            "completion_tokens",
            "draft_tokens",
            "accepted_tokens",
            "steps",
            "drafted_steps",
            "mean_accepted_length",
            "acceptance_rate",
            "time_to_first_token_s",
            "time_per_output_token_s",
        ):
            span.set_attribute(f"minedraft.usage.{field}", getattr(usage, field))
        span.set_attribute("minedraft.usage.accepted_per_position", list(usage.accepted_per_position))
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def links_to(spans: Iterable[Span | None]) -> list[Link]:
    """Links to the request spans a batched call serves (one trace per step, linked to every request's trace)."""
    return [Link(span.get_span_context()) for span in spans if span is not None]


@contextmanager
def batch_span(tracer: Tracer, name: str, links: Sequence[Link], attributes: Mapping[str, Any]) -> Iterator[Span]:
    """A current CLIENT span around one batched worker call; the call's metadata carries it to the worker."""
    with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, links=links, attributes=attributes) as span:
        yield span
