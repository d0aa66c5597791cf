"""The OpenAI-compatible HTTP API: FastAPI on uvicorn in the coordinator's event loop, over the front door."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import Message, Receive, Scope, Send

from coordinator.connection_gate import ConnectionGate, GatedListener, gated_protocol
from coordinator.front_door import FrontDoor, Generation, RequestRefused
from coordinator.http_answers import Answers, ApiError, Echo, answer_events, token_entries
from coordinator.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Reply,
    SamplingBody,
    TokenizeRequest,
    error_body,
    structured_output,
)
from coordinator.sampling_params import sampling_params
from coordinator.tool_calls import ToolChoice
from coordinator.validation import DEFAULT_MAX_TOKENS, InvalidRequest, prompt_token_ids, render_chat
from minedraft.engine.sampling import MAX_LOGPROBS
from minedraft.observability.metrics import CoordinatorMetrics
from minedraft.proto import generation_pb2
from minedraft.rpc.limits import PUBLIC_LIMITS, ConnectionLimits
from minedraft.rpc.security import UNAUTHENTICATED, bearer_matches

log = logging.getLogger(__name__)
T = TypeVar("T")
# Paths served without the API key: probes and scrapers carry none (vLLM's key guards /v1 only).
OPEN_PATHS = frozenset(("/health", "/health/", "/metrics", "/version"))


def _version() -> str:
    try:
        return importlib.metadata.version("minedraft")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _version()
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it, the logs may


def _invalid(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, "invalid_argument")


def create_app(front: FrontDoor, metrics: CoordinatorMetrics | None = None) -> FastAPI:
    """The routes, over `front`; its target model is the one model served; /metrics serves `metrics`' registry."""
    app = FastAPI(title="MineDraft", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

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

    @app.get("/metrics")
    async def prometheus() -> Response:
        if metrics is None:
            raise ApiError(404, "this coordinator keeps no metrics", "invalid_request_error")
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tokenizer = _tokenizer(front)
        if body.model is not None:
            _checked_model(body.model, front.model_names)
        if (body.prompt is None) == (body.messages is None):
            raise _invalid("give one of prompt and messages", "prompt")
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            messages = [generation_pb2.ChatMessage(role=m.role, content=m.text) for m in body.messages or ()]
            request = generation_pb2.GenerateRequest(messages=messages)
            vocab = front.workers.pair.target_info.logits_size
            try:
                ids = await asyncio.to_thread(prompt_token_ids, request, tokenizer, vocab)
            except InvalidRequest as exc:
                raise _invalid(str(exc), exc.param) from exc
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": front.context_length, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        tokenizer = _tokenizer(front)
        if body.model is not None:
            _checked_model(body.model, front.model_names)
        vocab = front.workers.pair.target_info.logits_size
        outside = [t for t in body.tokens if not 0 <= t < vocab]
        if outside:
            raise _invalid(f"token id {outside[0]} is outside the vocabulary (0 to {vocab - 1})", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        models = [
            {
                "id": name,
                "object": "model",
                "created": started,
                "owned_by": "minedraft",
                "root": front.workers.pair.target_info.model,
                "max_model_len": front.context_length,
            }
            for name in front.model_names
        ]
        return {"object": "list", "data": models}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        generate = _checked(body, front.model_names)
        prompts: list[str | list[int]]
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str | list):
            prompts = list(body.prompt)  # type: ignore[arg-type]
        else:
            prompts = [body.prompt]  # type: ignore[list-item]
        if body.logprobs is not None:
            generate.params.logprobs = body.logprobs
        echo = Echo(prompts, bool(body.echo) and body.max_tokens == 0, body.logprobs or 0) if body.echo else None
        if echo is not None:
            if echo.prompt_only:  # (vLLM's way: one token generated, and not answered)
                generate.params.max_tokens = 1
            if body.logprobs is not None:  # (with vLLM's prompt_logprobs: the more of the two, echo's trimmed)
                generate.params.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        requests = []
        for prompt in prompts:  # each its own request; its choices follow the previous prompt's (OpenAI's order)
            one = generation_pb2.GenerateRequest()
            one.CopyFrom(generate)
            if isinstance(prompt, str):
                one.prompt = prompt
            else:
                one.prompt_token_ids.extend(prompt)
            requests.append(one)
        reply = Reply(
            chat=False, model=body.model, include_usage=body.include_usage, continuous_usage=body.continuous_usage
        )
        return await _answer(front, request, body, requests, reply, DEFAULT_MAX_TOKENS, "/v1/completions", echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None and body.max_tokens != body.max_completion_tokens:
                raise _invalid("max_tokens and max_completion_tokens differ: give one", "max_tokens")
            body.max_tokens = body.max_completion_tokens
        generate = _checked(body, front.model_names)
        if not body.messages:
            raise _invalid("messages is empty", "messages")
        try:
            tools = body.tool_choice_of(front.options.tool_call_parser)
        except ValueError as exc:
            raise _invalid(str(exc), "tool_choice") from exc
        if tools is not None and tools.forced:  # the call's JSON constrained: the model cannot write an invalid one
            if generate.params.HasField("structured_output"):
                raise _invalid(f"tool_choice {tools.mode} makes the answer a call: give no other format", "tool_choice")
            schema = tools.call_schema(body.tools_for_template(tools) or [])
            generate.params.structured_output.json_schema = schema
            generate.params.structured_output.disable_any_whitespace = True
        if tools is not None or any(m.tool_calls or m.tool_call_id for m in body.messages):
            # The template renders the tools and the calls: here, where the request's JSON is (gRPC's messages
            # carry a role and a text only).
            generate.prompt_token_ids.extend(await _tool_prompt(front, body, tools))
        else:
            generate.messages.extend(generation_pb2.ChatMessage(role=m.role, content=m.text) for m in body.messages)
        if body.top_logprobs is not None and not body.logprobs:
            raise _invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if (body.top_logprobs or 0) > MAX_LOGPROBS:  # (the gRPC field's name would be logprobs)
            raise _invalid(f"top_logprobs must be at most {MAX_LOGPROBS}, got {body.top_logprobs}", "top_logprobs")
        if body.logprobs:
            generate.params.logprobs = body.top_logprobs or 0
        reply = Reply(
            chat=True,
            model=body.model,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            tools=tools,
        )
        # As OpenAI's chat completions: without max_tokens, up to the end of the context.
        return await _answer(front, request, body, [generate], reply, None, "/v1/chat/completions")

    return app


def _checked(body: SamplingBody, names: list[str]) -> generation_pb2.GenerateRequest:
    """The request's sampling as the gRPC API takes it, once its model is the one served (by one of its `names`)
    and it asks for nothing this server does not do yet."""
    _checked_model(body.model, names)
    ignored = body.ignored_fields()
    if ignored:  # (one line a request, its first names only: nothing is kept per name)
        log.warning("a request's fields this server does not know, ignored: %s", ", ".join(ignored[:8])[:200])
    if body.prompt_logprobs is not None and body.stream:  # (as vLLM)
        raise _invalid("prompt_logprobs is answered whole only: set stream to false", "prompt_logprobs")
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
        "logit_bias": _logit_bias(body),
    }
    params = sampling_params({**dict(body), **openai})
    try:
        structured = structured_output(body)
    except ValueError as exc:
        raise _invalid(*exc.args) from exc
    if structured is not None:
        params.structured_output.CopyFrom(structured[0])
    return generation_pb2.GenerateRequest(params=params, n=body.n or 0)


def _logit_bias(body: SamplingBody) -> dict[int, float] | None:
    try:
        return body.logit_bias_of()
    except ValueError as exc:
        raise _invalid(str(exc), "logit_bias") from exc


async def _tool_prompt(front: FrontDoor, body: ChatCompletionRequest, tools: ToolChoice | None) -> list[int]:
    """The chat's prompt, its tools and tool calls rendered by the chat template, then what a forced choice opens
    the assistant's turn with (`ToolChoice.forced_prefix`)."""
    conversation = [m.for_template() for m in body.messages]
    shown = body.tools_for_template(tools)
    limits = front.options.limits
    size = len(json.dumps([conversation, shown]).encode())
    if size > limits.max_prompt_bytes:
        message = f"the messages and tools are {size} bytes; this server takes at most {limits.max_prompt_bytes}"
        raise _invalid(message + " (--max-prompt-bytes)", "messages")
    if len(conversation) > limits.max_messages:
        raise _invalid(f"{len(conversation)} messages; this server takes at most {limits.max_messages}", "messages")
    tokenizer = _tokenizer(front)

    def render() -> list[int]:
        ids = render_chat(conversation, tokenizer, shown)
        prefix = tools.forced_prefix if tools is not None else ""
        return ids + (tokenizer.encode(prefix, add_special_tokens=False) if prefix else [])

    try:
        return await asyncio.to_thread(render)
    except InvalidRequest as exc:
        raise _invalid(str(exc), exc.param) from exc


def _checked_model(model: str, names: list[str]) -> None:
    """404 (OpenAI's model_not_found) unless `model` is one of the served model's `names`."""
    if model not in names:
        message = f"the model {model!r} does not exist: this server serves {' or '.join(map(repr, names))}"
        raise ApiError(404, message, "invalid_request_error", "model", "model_not_found")


def _tokenizer(front: FrontDoor) -> Any:
    if front.tokenizer is None:
        raise _invalid("this server has no tokenizer (--tokenizer): it serves token ids only", None)
    return front.tokenizer


async def _answer(
    front: FrontDoor,
    request: Request,
    body: SamplingBody,
    generates: list[generation_pb2.GenerateRequest],
    reply: Reply,
    default_max_tokens: int | None,
    route: str,
    echo: Echo | None = None,
) -> Response:
    """Admit `generates` (a request's prompts, most often one) and answer them as one, whole or streamed: their
    choices in order, prompt by prompt (each after its prompt, with `echo`); they are cancelled if the client goes
    away."""
    generations: list[Generation] = []
    try:
        for generate in generates:
            generations.append(await front.admit(generate, request.headers.items(), default_max_tokens, route))
    except BaseException as exc:
        for generation in generations:
            front.close(generation)
        if isinstance(exc, RequestRefused) and (exc.param or "").startswith("structured_output"):
            structured = structured_output(body)  # a constraint the engine cannot read: named as the client gave it
            exc.param = structured[1] if structured is not None else "tools"  # (else a forced call's schema)
        raise
    entries = token_entries(generates[0], front.tokenizer, reply.chat)
    answers = Answers(front, generations, entries, echo, prompt_logprobs=body.prompt_logprobs is not None)

    def close() -> None:
        for generation in generations:
            front.close(generation)

    if body.stream:
        return EventStream(answer_events(answers, reply), close)
    try:
        whole = await _while_connected(request.receive, answers.collect())
    finally:
        close()
    if whole is None:
        return Response(status_code=CLIENT_GONE)
    answer = reply.whole(whole, answers.usage())
    if answers.prompt_logprobs is not None and reply.chat:  # vLLM's: a chat's (one prompt) beside its choices
        answer["prompt_logprobs"] = answers.prompt_logprobs[0]
    elif answers.prompt_logprobs is not None:  # a completion's in each choice
        for choice, prompt_logprobs in zip(answer["choices"], answers.prompt_logprobs, strict=True):
            choice["prompt_logprobs"] = prompt_logprobs
    return JSONResponse(answer)


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
    body is read; /health, /metrics and /version stay open (probes and scrapers carry no secret)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Coroutine[Any, Any, None]], api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
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
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        app = BodyLimit(create_app(front, metrics), front.options.max_request_bytes)
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


def bind_http(host: str, port: int) -> socket.socket:
    """The HTTP API's listening socket, bound before the coordinator starts; OSError naming the port and its flag
    if it cannot listen."""
    try:
        return listen(host, port)
    except OSError as exc:
        raise OSError(f"the HTTP API cannot listen on {host} port {port} (--http-port; 0 turns it off): {exc}") from exc


def start_http_server(
    front: FrontDoor,
    sock: socket.socket,
    api_key: str | None = None,
    limits: ConnectionLimits = PUBLIC_LIMITS,
    metrics: CoordinatorMetrics | None = None,
) -> HttpServer:
    """The HTTP API on `sock` (`bind_http`), started in this event loop beside the gRPC server (HTTPS with the
    front's --tls-cert, the bearer token `api_key` wanted where given, connections within `limits`; /metrics of
    `metrics`' registry where given)."""
    http = HttpServer(front, sock, api_key, limits, metrics)
    log.info("OpenAI-compatible HTTP API on port %d (/v1/completions, /v1/chat/completions, /v1/models)", http.port)
    return http
