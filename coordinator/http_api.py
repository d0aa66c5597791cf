"""The OpenAI-compatible HTTP API: FastAPI on uvicorn in the coordinator's event loop, over the front door."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from coordinator.connection_gate import ConnectionGate, GatedListener, gated_protocol
from coordinator.front_door import FrontDoor, Generation, RequestRefused
from coordinator.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Reply,
    SamplingBody,
    TokenEntry,
    error_body,
    finish_reason,
    structured_output,
)
from coordinator.sampling_params import sampling_params
from coordinator.validation import DEFAULT_MAX_TOKENS
from minedraft.engine.sampling import MAX_LOGPROBS
from minedraft.proto import generation_pb2
from minedraft.rpc.limits import PUBLIC_LIMITS, ConnectionLimits
from minedraft.rpc.security import UNAUTHENTICATED, bearer_matches

log = logging.getLogger(__name__)
T = TypeVar("T")

# gRPC status -> HTTP status and OpenAI's error type; anything else is a 500 server_error.
STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}
# Names of gRPC request fields in the HTTP API, for an error's `param`.
PARAMS = {"prompt_token_ids": "prompt", "stop_token_ids": "stop_token_ids"}
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the logs may


class ApiError(Exception):
    """An error answered as OpenAI's error object with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)

    @staticmethod
    def of(refused: RequestRefused) -> ApiError:
        status, kind = STATUS.get(refused.code, (500, "server_error"))
        param = PARAMS.get(refused.param, refused.param) if refused.param else None
        return ApiError(status, refused.message, kind, param, refused.code.name.lower())


def _invalid(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "invalid_argument")


def create_app(front: FrontDoor) -> FastAPI:
    """The routes, over `front`; its target model is the one model served."""
    app = FastAPI(title="MineDraft", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    def model_name() -> str:
        return front.model

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body, exc.status)

    @app.exception_handler(RequestRefused)
    async def refused(request: Request, exc: RequestRefused) -> JSONResponse:
        error = ApiError.of(exc)
        return JSONResponse(error.body, error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(part) for part in error.get("loc", ())[1:]) or None
        if error.get("type") == "extra_forbidden":
            message = f"{param} is not supported by this server"
        else:
            message = f"{param}: {error.get('msg', 'invalid')}" if param else str(error.get("msg", "invalid body"))
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code)

    @app.get("/health")
    @app.get("/health/", include_in_schema=False)  # (not a redirect: a probe may not follow one)
    async def health() -> Response:
        serving = front.health.serving()
        return JSONResponse({"status": "serving" if serving else "not_serving"}, 200 if serving else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = {
            "id": model_name(),
            "object": "model",
            "created": started,
            "owned_by": "minedraft",
            "max_model_len": front.context_length,
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        generate = _checked(body, model_name())
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise _invalid("several prompts in one request are not supported yet: send one", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            generate.prompt = prompt
        else:
            generate.prompt_token_ids.extend(prompt)  # type: ignore[arg-type]
        if body.logprobs is not None:
            generate.params.logprobs = body.logprobs
        reply = Reply(chat=False, model=model_name(), include_usage=body.include_usage)
        return await _answer(front, request, body, generate, reply, DEFAULT_MAX_TOKENS, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise _invalid("max_tokens and max_completion_tokens differ: give one", "max_tokens")
            body.max_tokens = body.max_completion_tokens
        generate = _checked(body, model_name())
        if not body.messages:
            raise _invalid("messages is empty", "messages")
        generate.messages.extend(generation_pb2.ChatMessage(role=m.role, content=m.text) for m in body.messages)
        if body.top_logprobs is not None and not body.logprobs:
            raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if (body.top_logprobs or 0) > MAX_LOGPROBS:  # (the gRPC field's name would be logprobs)
            raise _invalid(f"top_logprobs must be at most {MAX_LOGPROBS}, got {body.top_logprobs}", "top_logprobs")
        if body.logprobs:
            generate.params.logprobs = body.top_logprobs or 0
        reply = Reply(chat=True, model=model_name(), include_usage=body.include_usage)
        # As OpenAI's chat completions: without max_tokens, up to the end of the context.
        return await _answer(front, request, body, generate, reply, None, "/v1/chat/completions")

    return app


def _checked(body: SamplingBody, model: str) -> generation_pb2.GenerateRequest:
    """The request's sampling as the gRPC API takes it, once its model is the one served and it asks for nothing
    this server does not do yet."""
    if body.model != model:
        message = f"the model {body.model!r} does not exist: this server serves {model!r}"
        raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")
    ignored = body.ignored_fields()
    if ignored:  # (one line a request, its first names only: nothing is kept per name)
        log.warning("a request's fields this server does not know, ignored: %s", ", ".join(ignored[:8])[:200])
    unsupported = body.unsupported()
    if unsupported is not None:
        name, value = unsupported
        raise _invalid(f"{name}={value!r} is not supported yet by this server", name)
    # The body's fields named as SamplingParams' are its values (None: unset), but where OpenAI's differ: the
    # default temperature is 1, stop may be one string, a top_k of -1 is off; logprobs is each route's own (a
    # chat's is a bool).
    openai = {
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "stop": [body.stop] if isinstance(body.stop, str) else body.stop,
        "top_k": max(body.top_k or 0, 0),
        "logprobs": None,
        "presence_penalty": body.presence_penalty or 0.0,  # -0.0 sent as 0.0 (here and in the next two)
        "frequency_penalty": body.frequency_penalty or 0.0,
        "min_p": body.min_p or 0.0,
    }
    params = sampling_params({**dict(body), **openai})
    try:
        structured = structured_output(body)
    except ValueError as exc:
        raise _invalid(*exc.args) from exc
    if structured is not None:
        params.structured_output.CopyFrom(structured[0])
    return generation_pb2.GenerateRequest(params=params, n=body.n or 0)


async def _answer(
    front: FrontDoor,
    request: Request,
    body: SamplingBody,
    generate: generation_pb2.GenerateRequest,
    reply: Reply,
    default_max_tokens: int | None,
    route: str,
) -> Response:
    """Admit `generate` and answer it, whole or streamed; the request is cancelled if its client goes away."""
    try:
        generation = await front.admit(generate, request.headers.items(), default_max_tokens, route)
    except RequestRefused as exc:  # a constraint the engine cannot read: named as the client gave it
        structured = structured_output(body) if (exc.param or "").startswith("structured_output") else None
        if structured is not None:
            exc.param = structured[1]
        raise
    entries = _entries(generate, front.tokenizer)
    if body.stream:
        return EventStream(_events(front, generation, reply, entries), lambda: front.close(generation))
    try:
        whole = await _while_connected(request.receive, _collect(front, generation, entries))
    finally:
        front.close(generation)
    if whole is None:
        return Response(status_code=CLIENT_GONE)
    return JSONResponse(reply.whole(whole, generation.usage))


Entries = Callable[[generation_pb2.GenerateResponse], list[TokenEntry]]


def _entries(generate: generation_pb2.GenerateRequest, tokenizer: object | None) -> Entries | None:
    """How a message's tokens become its logprobs' entries, each token's text decoded alone ("token_id:N" without
    a tokenizer, as vLLM's return_tokens_as_token_ids), if the request asked for logprobs."""
    if not generate.params.HasField("logprobs"):
        return None

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"  # type: ignore[attr-defined]

    def entries(message: generation_pb2.GenerateResponse) -> list[TokenEntry]:
        return [
            (text(token_id), lp.logprob, [(text(top.token_id), top.logprob) for top in lp.top])
            for token_id, lp in zip(message.token_ids, message.logprobs, strict=True)
        ]

    return entries


async def _collect(
    front: FrontDoor,
    generation: Generation,
    logprobs: Entries | None,
) -> list[tuple[str, str | None, list[TokenEntry] | None]]:
    """Each choice's text, finish reason and logprobs (when asked), by index."""
    n = max(len(generation.samples), 1)
    texts: list[list[str]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    entries: list[list[TokenEntry] | None] = [[] if logprobs else None for _ in range(n)]
    async for message in front.responses(generation):
        texts[message.index].append(message.text)
        reasons[message.index] = finish_reason(message.finish_reason)
        if logprobs is not None:
            entries[message.index] += logprobs(message)  # type: ignore[operator]
    return [("".join(text), reason, e) for text, reason, e in zip(texts, reasons, entries)]


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


async def _events(
    front: FrontDoor,
    generation: Generation,
    reply: Reply,
    logprobs: Entries | None,
) -> AsyncIterator[str]:
    """The answer as server-sent events, as OpenAI streams it: (chat: the role first), text deltas (each with its
    tokens' logprobs, when asked), a chunk with the finish reason, the usage if asked, then [DONE]; a failure midway
    is an error object before [DONE]."""
    offsets = [0] * max(len(generation.samples), 1)  # each choice's text so far (a completion's text_offset)
    for index in range(max(len(generation.samples), 1)):
        opening = reply.opening(index)
        if opening is not None:
            yield _sse(opening)
    try:
        async for message in front.responses(generation):
            entries = logprobs(message) if logprobs is not None and message.token_ids else None
            if message.text or entries:
                i = message.index
                yield _sse(reply.delta(message.text, index=i, entries=entries, offset=offsets[i]))
                offsets[i] += sum(len(token) for token, _, _ in entries or ())
            reason = finish_reason(message.finish_reason)
            if reason is not None:
                yield _sse(reply.delta("", reason, message.index))
        if reply.include_usage and generation.usage is not None:
            yield _sse(reply.usage_chunk(generation.usage))
    except RequestRefused as exc:
        yield _sse(ApiError.of(exc).body)
    yield _sse("[DONE]")


class EventStream(StreamingResponse):
    """A server-sent event stream that stops as soon as its client disconnects (whatever the server's ASGI version)
    and calls `on_close` however it ends, even if it never started: the request is then cancelled and freed."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _while_connected(receive, self.stream_response(send))
        except OSError:  # the client went away while a chunk was sent (how ASGI 2.4 servers say it)
            pass
        finally:
            self.on_close()


async def _while_connected(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None if the client disconnected first (`work` is then cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request's body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class BodyLimit:
    """Refuse a body beyond `max_bytes` (--max-request-bytes) with 400 and OpenAI's error object: at once when its
    Content-Length says so, else (chunked) as soon as the bytes read pass it, so it is never held whole. A chunked
    body is read here, before the app (which would answer any error of its reading as a body that does not parse)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]], max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self, size: str) -> str:
        return f"the request body is {size} bytes; this server takes at most {self.max_bytes} (--max-request-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit():
            if int(length) <= self.max_bytes:
                await self.app(scope, receive, send)
                return
            size = str(int(length))
        else:
            messages, read = [], 0
            while True:
                message = await receive()
                messages.append(message)
                read += len(message.get("body", b""))
                if read > self.max_bytes or message["type"] != "http.request" or not message.get("more_body"):
                    break
            if read <= self.max_bytes:
                await self.app(scope, _replay(messages, receive), send)
                return
            size = f"more than {self.max_bytes}"
        body = error_body(self._message(size), "invalid_request_error", None, "invalid_argument")
        await JSONResponse(body, 400)(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives `messages` first, then what `receive` gives."""
    pending = iter(messages)

    async def replayed() -> Message:
        return next(pending, None) or await receive()

    return replayed


class ApiKeyAuth:
    """Refuse a request without `Authorization: Bearer <api_key>` with 401 and OpenAI's error object, before its
    body is read; /health stays open (probes carry no secret)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]], api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/health", "/health/"):
            header = dict(scope["headers"]).get(b"authorization")
            if not bearer_matches(header, self.api_key):
                body = error_body(UNAUTHENTICATED, "invalid_request_error", None, "invalid_api_key")
                await JSONResponse(body, 401, headers={"www-authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the coordinator's own handle SIGINT and SIGTERM (the drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The HTTP API serving as a task of the coordinator's event loop, on a socket bound before it starts (so that
    a port in use fails the start-up at once), whose connections go through a `ConnectionGate` of `limits`."""

    def __init__(
        self,
        front: FrontDoor,
        sock: socket.socket,
        api_key: str | None = None,
        limits: ConnectionLimits = PUBLIC_LIMITS,
    ) -> None:
        app = BodyLimit(create_app(front), front.options.max_request_bytes)
        options = front.options
        self.gate = ConnectionGate(limits)
        listener = GatedListener.of(sock, self.gate)
        config = uvicorn.Config(
            app if api_key is None else ApiKeyAuth(app, api_key),
            # TLS only, with the gRPC port's certificate (uvicorn reads the files at its start)
            ssl_certfile=options.tls_cert,
            ssl_keyfile=options.tls_key,
            lifespan="off",
            log_config=None,  # the coordinator's logging as it is
            access_log=False,
            ws="none",
            server_header=False,
            timeout_graceful_shutdown=5,  # open streams end with the step loop's shutdown before this runs out
            http=gated_protocol(self.gate),
            timeout_keep_alive=max(int(limits.idle_timeout), 1),  # (the gate's deadline cuts a slow request too)
        )
        if options.tls_cert:
            config.load()  # here: a certificate that does not load fails the start-up, not the task later
        self.port = int(listener.getsockname()[1])
        # Its start and stop lines would say "server process": it is a task of this one.
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        self.server = _Server(config)
        self.gate.quiet_accept_errors(listener)
        self.task = asyncio.create_task(self.server.serve(sockets=[listener]))
        self.task.add_done_callback(_log_failure)
        self._gate_task = asyncio.create_task(self.gate.run())
        self.task.add_done_callback(lambda _: self._gate_task.cancel())

    def begin_stop(self) -> None:
        """Stop taking connections (uvicorn notices within 0.1 s); the open ones finish."""
        self.server.should_exit = True

    async def stopped(self) -> None:
        self.begin_stop()
        await self.task


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the HTTP API stopped", exc_info=task.exception())


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` (as the gRPC `--host` takes it: "[::]" is every address, IPv4 too)."""
    host = host.strip("[]")
    if host in ("", "::"):
        dual = socket.has_dualstack_ipv6()
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=dual)
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


def start_http_server(
    front: FrontDoor,
    port: int,
    host: str,
    api_key: str | None = None,
    limits: ConnectionLimits = PUBLIC_LIMITS,
) -> HttpServer:
    """The HTTP API on `port`, started in this event loop beside the gRPC server (HTTPS with the front's
    --tls-cert, the bearer token `api_key` wanted where given, connections within `limits`); OSError if it cannot
    listen."""
    try:
        sock = listen(host, port)
    except OSError as exc:
        raise OSError(f"the HTTP API cannot listen on {host} port {port} (--http-port; 0 turns it off): {exc}") from exc
    http = HttpServer(front, sock, api_key, limits)
    log.info("OpenAI-compatible HTTP API on port %d (/v1/completions, /v1/chat/completions, /v1/models)", http.port)
    return http
