"""What every gRPC server here shares: start-up with health and reflection, error mapping, timings."""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from minedraft.errors import (
    CapacityError,
    ChannelNotSetUpError,
    ChannelSetupError,
    InvalidRequest,
    LeaseError,
    LeaseSecretError,
    ModelLoadError,
    RankLostError,
    UnknownSequenceError,
)
from minedraft.proto import common_pb2
from minedraft.rpc.limits import WORKER_LIMITS, ConnectionLimits, raise_fd_limit
from minedraft.rpc.security import BearerAuth

log = logging.getLogger(__name__)

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])

# A health service name that stays SERVING while the process serves (a liveness probe's), whatever the others say
LIVENESS = "liveness"


class Health(health.aio.HealthServicer):
    """grpc.health.v1 with a drain that keeps the process alive to its liveness probe."""

    async def drain(self) -> None:
        """Every service NOT_SERVING for good (later `set` calls are ignored), except LIVENESS: a liveness probe
        that failed during a drain would have the pod killed before its admitted requests finish."""
        await self.enter_graceful_shutdown()
        await self._set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)

    def serving(self, service: str = "") -> bool:
        """Whether `service` ("": the server as a whole) reports SERVING now (what the HTTP API's /health says)."""
        return self._server_status.get(service) == health_pb2.HealthCheckResponse.SERVING


# Exceptions a handler may raise on bad input, exhausted capacity or a lost precondition: the status a caller gets
# for each, and for FAILED_PRECONDITION the reason (REASON_KEY) that tells a caller whether the worker is lost to it.
# Anything else (a plain ValueError too) is a fault of ours: INTERNAL.
_STATUS: list[tuple[type[BaseException], grpc.StatusCode, str]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, ""),
    (UnknownSequenceError, grpc.StatusCode.NOT_FOUND, ""),
    (RankLostError, grpc.StatusCode.UNAVAILABLE, ""),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    (ModelLoadError, grpc.StatusCode.FAILED_PRECONDITION, "model"),
    (ChannelNotSetUpError, grpc.StatusCode.FAILED_PRECONDITION, "channel"),
    (ChannelSetupError, grpc.StatusCode.FAILED_PRECONDITION, "channel-setup"),
    (LeaseSecretError, grpc.StatusCode.PERMISSION_DENIED, ""),
    (LeaseError, grpc.StatusCode.FAILED_PRECONDITION, "lease"),
]

# Trailing metadata of a FAILED_PRECONDITION (and a step stream's CallStatus.reason): "lease" (this caller's lease
# is not the worker's), "channel" (no channel set up: the worker restarted), "channel-setup" (SetupChannel's two
# ends could not meet) or "model" (it cannot serve the model).
REASON_KEY = "minedraft-reason"


def status_for(exc: BaseException) -> grpc.StatusCode:
    return _status_and_reason(exc)[0]


def _status_and_reason(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for kind, code, reason in _STATUS:
        if isinstance(exc, kind):
            return code, reason
    return grpc.StatusCode.INTERNAL, ""


def grpc_errors(handler: Handler) -> Handler:
    """Turn a unary handler's exceptions into a gRPC status with the exception's message (and REASON_KEY)."""

    @functools.wraps(handler)
    async def wrapped(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except (grpc.RpcError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            code, message, reason = error_status(exc, handler.__name__)
            await context.abort(code, message, ((REASON_KEY, reason),) if reason else ())

    return wrapped  # type: ignore[return-value]


def error_status(exc: Exception, call: str) -> tuple[grpc.StatusCode, str, str]:
    """The status, message and reason ("" or REASON_KEY's value) a call that raised `exc` ends with; an unexpected
    error is logged with its trace."""
    code, reason = _status_and_reason(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("%s failed", call, exc_info=exc)
    message = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return code, message or type(exc).__name__, reason


def timings(start_unix: float, compute_s: float, channel_s: float = 0.0, queue_s: float = 0.0) -> common_pb2.Timings:
    return common_pb2.Timings(
        compute_s=compute_s, channel_s=channel_s, queue_s=queue_s, start_unix_s=start_unix, end_unix_s=time.time()
    )


class _Malformed:
    """What a request that does not parse deserializes to: its handler then ends the call with INVALID_ARGUMENT."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Malformed(exc)

    return parse


_MALFORMED = "the request message does not parse (bad protobuf encoding, or a string field that is not UTF-8)"


class MalformedRequests(grpc.aio.ServerInterceptor):
    """A request that does not parse gets INVALID_ARGUMENT with a short message; grpc.aio itself would answer
    UNKNOWN with the Python exception's text and log a traceback at ERROR. Unary requests only (the step streams
    are internal)."""

    def __init__(self) -> None:
        # Keyed by the server's own methods alone: a name it does not serve finds no handler, and is never kept.
        self._handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        handler = self._handlers.get(method)
        if handler is None:  # wrapped once per method, not per call; the inner interceptors run once
            found = await continuation(handler_call_details)
            if found is None:
                return None
            handler = self._handlers[method] = _wrapped(found) or found
        return handler


def _wrapped(handler: Any) -> grpc.RpcMethodHandler[Any, Any] | None:
    """`handler` with a lenient deserializer and a behavior that refuses a `_Malformed` request; None: left as is."""
    if handler is None or handler.request_streaming or handler.request_deserializer is None:
        return None
    parse = _lenient(handler.request_deserializer)
    if handler.unary_unary is not None:
        unary = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)
            reply = unary(request, context)
            return await reply if inspect.isawaitable(reply) else reply

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, handler.response_serializer)  # type: ignore[arg-type]
    if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
        stream = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)
            async for message in stream(request, context):
                yield message

        return grpc.unary_stream_rpc_method_handler(unary_stream, parse, handler.response_serializer)  # type: ignore[arg-type]
    if handler.unary_stream is not None:  # one that writes with `context.write` (grpc.health.v1's Watch)
        writes = handler.unary_stream

        async def unary_writes(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED)
            return await writes(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_writes, parse, handler.response_serializer)  # type: ignore[arg-type]
    return None


async def start_server(
    port: int,
    register: Sequence[Callable[[grpc.aio.Server], None]],
    service_names: Sequence[str],
    host: str = "[::]",
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    health_servicer: Health | None = None,
    max_receive_bytes: int = 256 << 20,
    credentials: grpc.ServerCredentials | None = None,
    api_key: str | None = None,
    limits: ConnectionLimits = WORKER_LIMITS,
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with the given services plus grpc.health.v1 (`health_servicer`, if the caller wants
    to change what it reports later) and reflection of those alone; return it and its port. `max_receive_bytes`: the
    largest request message it reads (the workers' default is large: draft probabilities travel in theirs).
    `credentials`: TLS (`minedraft.rpc.security`; None: plaintext); `api_key`: the bearer token every call but
    health and reflection must carry; `limits`: the port's connection cap and timeouts."""
    # The token is checked first, at every call: MalformedRequests caches per method what runs inside it.
    auth = [BearerAuth(api_key)] if api_key else []
    raise_fd_limit()
    server = grpc.aio.server(
        interceptors=[*auth, MalformedRequests(), *interceptors],
        options=[
            ("grpc.max_send_message_length", 256 << 20),
            ("grpc.max_receive_message_length", max_receive_bytes),
            *limits.grpc_options(),
            *KEEPALIVE_ALLOWED,
            # gRPC sets SO_REUSEPORT by default: a second server given a port another one holds would bind it too,
            # and the kernel would hand each new connection to either (a coordinator talking to a stranger).
            ("grpc.so_reuseport", 0),
        ],
    )
    for add in register:
        add(server)
    health_servicer = Health() if health_servicer is None else health_servicer
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    served = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(served, server, pool=descriptors_of(served))
    address = f"{host}:{port}"
    try:
        bound = (
            server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
        )
    except RuntimeError:  # grpc says only "Failed to bind", and why on stderr
        bound = 0
    if bound == 0:
        raise OSError(f"the gRPC API cannot listen on {host} port {port} (--port): in use, or not an address here")
    # Everything loaded so far (models, tokenizer, libraries: some 400k objects) lives as long as the process. Frozen,
    # the garbage collector skips it: a full collection while serving (or before each CUDA graph capture) then
    # takes microseconds instead of 0.1-0.4 s.
    gc.collect()
    gc.freeze()
    await server.start()
    for name in ("", LIVENESS, *service_names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


def descriptors_of(service_names: Sequence[str]) -> descriptor_pool.DescriptorPool:
    """A pool of the files that declare `service_names`, and their imports, alone: reflection over the default pool
    would describe every proto this process imported (the coordinator's internal worker protos too)."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        pool.Add(proto)
        added.add(file.name)

    for name in service_names:
        add(descriptor_pool.Default().FindServiceByName(name).file)
    return pool


# What a server lets its clients' keepalive pings do (`worker_channel_options`): ping as often as each second, with
# or without calls in flight, never answered with a GOAWAY for pinging too often.
KEEPALIVE_ALLOWED = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    # A worker that restarts is dialled again within a second or two, not after gRPC's default backoff (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def worker_channel_options(keepalive_s: float) -> list[tuple[str, int]]:
    """A coordinator's channel to a worker: CHANNEL_OPTIONS, and an HTTP/2 ping every `keepalive_s` seconds that
    must be answered within as long, calls in flight or not. A stopped or hung worker process answers no ping (the
    kernel still acknowledges its TCP), so its connection breaks and every call on it fails UNAVAILABLE within
    twice `keepalive_s`, whatever call it was (a prefill's, a release's) and however long that call's deadline."""
    every_ms = max(int(keepalive_s * 1000), 1000)
    return [
        *CHANNEL_OPTIONS,
        ("grpc.keepalive_time_ms", every_ms),
        ("grpc.keepalive_timeout_ms", every_ms),
        ("grpc.http2.ping_timeout_ms", every_ms),  # (what closes the connection on a ping unanswered; 1 min else)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_time_between_pings_ms", every_ms),  # (5 minutes by default without data)
    ]
