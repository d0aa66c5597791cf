"""The `minedraft` command: serve, target, draft, coordinator, generate, bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from minedraft.flag_spec import FLAG_KEY
from minedraft.rpc.lease import new_secret
from minedraft.rpc.security import bearer_metadata, client_tls, read_api_key, sync_channel, worker_credentials
from minedraft_app.flags import COMMANDS, LOOPBACK, SERVICE_COMMANDS, add_flags
from minedraft_app.stack import (
    check_stack_tls,
    drain_process,
    ports_taken,
    service_args,
    start_stack,
    stop_processes,
)

if TYPE_CHECKING:
    from coordinator.options import CoordinatorOptions
    from minedraft.proto import generation_pb2
    from minedraft.rpc.options import WorkerOptions

Options = TypeVar("Options")
ENV_EPILOG = (
    "MINEDRAFT_<FLAG> in the environment sets any of these flags (MINEDRAFT_MAX_BATCH_SIZE=8, "
    "MINEDRAFT_COMPILE=true); docs/cli.md lists every flag with its variable and Helm value."
)


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        default = action.default
        shown = default not in (None, argparse.SUPPRESS) and default is not False and default != []
        return (action.help or "") + (" (default: %(default)s)" if action.option_strings and shown else "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command, summary in COMMANDS.items():
        epilog = ENV_EPILOG if command in SERVICE_COMMANDS else None
        add_flags(
            sub.add_parser(command, help=summary, description=summary, epilog=epilog, formatter_class=HelpFormatter),
            command,
        )
    return parser


def _from_args(cls: Callable[..., Options], args: argparse.Namespace, **derived: object) -> Options:
    """`cls(...)` of the arguments of its fields' flags (`minedraft.flag_spec.flag`; a field without one: the
    argument of its name); fields `args` lacks keep their defaults."""
    given: dict[str, object] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = field.metadata[FLAG_KEY].dest if FLAG_KEY in field.metadata else field.name
        if field.name not in derived and hasattr(args, name):
            given[field.name] = getattr(args, name)
    return cls(**given, **derived)


def worker_options(args: argparse.Namespace) -> WorkerOptions:
    """A target's or draft's options, from its arguments (serve --single-process gives it what serve passes on;
    what it lacks keeps its default)."""
    from minedraft.rpc.options import WorkerOptions

    caching = getattr(args, "enable_prefix_caching", "on") == "on"
    return _from_args(WorkerOptions, args, cuda_graphs=not args.eager, prefix_caching=caching)


def coordinator_options(args: argparse.Namespace) -> CoordinatorOptions:
    """The coordinator's options, from its arguments (as for `worker_options`)."""
    from coordinator.options import CoordinatorOptions

    return _from_args(CoordinatorOptions, args)


def _drafter(args: argparse.Namespace) -> str:
    """What drafts in a serve stack, for its start-up line."""
    method = getattr(args, "speculative_method", "auto")
    return "drafts by n-gram lookup" if method == "ngram" else f"draft {args.draft}"


def _run_until_signal(main: Coroutine[Any, Any, None]) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main)


async def _serve_forever(
    server: grpc.aio.Server,
    name: str,
    port: int,
    on_stop: object = None,
    port_file: str | None = None,
    drain: Callable[[asyncio.Event], Awaitable[None]] | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM; after a SIGTERM first `drain(cut_short)`, which another signal cuts short."""
    stop, terminated = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        terminated.set()
        stop.set()

    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    print(f"{name} listening on port {port}", flush=True)
    if port_file:
        Path(port_file + ".tmp").write_text(str(port))
        os.replace(port_file + ".tmp", port_file)  # a reader never sees it half written
    await stop.wait()
    if drain is not None and terminated.is_set():
        stop.clear()
        await drain(stop)
    if on_stop is not None:
        await on_stop  # type: ignore[misc]
    await server.stop(grace=2)


async def _worker_main(args: argparse.Namespace, kind: str) -> None:
    from minedraft.observability.metrics import WorkerMetrics, start_metrics_server
    from minedraft.observability.telemetry import server_interceptors, setup_tracing

    worker_credentials(args.tls_cert, args.tls_key, args.tls_ca)  # a wrong TLS flag fails before the model loads
    tracing = setup_tracing(f"minedraft-{kind}")
    metrics = WorkerMetrics() if args.metrics_port else None
    if metrics is not None:
        start_metrics_server(args.metrics_port, args.metrics_host or args.host, metrics.registry)
    interceptors = server_interceptors(tracing, metrics.observe_call if metrics is not None else None)
    options = worker_options(args)
    try:
        if kind == "target":
            from target_service.server import serve as serve_target

            server, port, drain = await serve_target(options, args.port, args.host, interceptors, metrics)
        else:
            from draft_service.server import serve as serve_draft

            server, port, drain = await serve_draft(
                options, args.port, args.host, args.greedy_drafts, interceptors, metrics
            )
        await _serve_forever(server, kind, port, port_file=args.port_file, drain=drain)
    finally:
        tracing.shutdown()  # export the spans still queued


async def _coordinator_main(args: argparse.Namespace) -> None:
    from coordinator.main import serve
    from minedraft.observability.metrics import CoordinatorMetrics, start_metrics_server
    from minedraft.observability.telemetry import setup_tracing

    options = coordinator_options(args)
    tracing = setup_tracing("minedraft-coordinator")
    metrics = CoordinatorMetrics() if args.metrics_port or args.http_port else None  # (the HTTP port's /metrics too)
    if args.metrics_port and metrics is not None:  # on loopback unless asked: --host is the public port's
        start_metrics_server(args.metrics_port, args.metrics_host or LOOPBACK, metrics.registry)
    try:
        server, port, coordinator = await serve(options, args.port, args.host, tracing, metrics)
        await _serve_forever(server, "coordinator", port, coordinator.stop(), args.port_file, coordinator.drain)
    finally:
        tracing.shutdown()  # export the spans still queued


async def _single_process_main(args: argparse.Namespace) -> None:
    """The whole stack in one process: each worker on its own thread and CUDA stream, drafts over `local`."""
    from coordinator.main import serve as serve_coordinator
    from draft_service.server import serve as serve_draft
    from minedraft.observability.metrics import CoordinatorMetrics
    from target_service.server import serve as serve_target

    # Each model runner captures its CUDA graphs on a stream of its own: two threads capturing on the one stream
    # that PyTorch shares across threads hang.
    servers = []
    server, target_port, _ = await serve_target(worker_options(service_args(args, "target")), 0, "127.0.0.1")
    servers.append(server)
    draft_address = None
    if args.mode != "ar":
        server, draft_port, _ = await serve_draft(worker_options(service_args(args, "draft")), 0, "127.0.0.1")
        servers.append(server)
        draft_address = f"127.0.0.1:{draft_port}"
    coordinator_args = service_args(
        args, "coordinator", target=f"127.0.0.1:{target_port}", draft=draft_address, api_key=args.api_key
    )
    if coordinator_args.channel == "auto":
        coordinator_args.channel = "local"
    metrics = CoordinatorMetrics() if args.http_port else None  # (its /metrics)
    server, port, coordinator = await serve_coordinator(
        coordinator_options(coordinator_args), args.port, args.host, metrics=metrics
    )
    print(
        f"minedraft serving {args.mode} on localhost:{port} in one process (target {args.target}, {_drafter(args)})",
        flush=True,
    )
    if args.generate:
        request = _generate_args(args, f"localhost:{port}", read_api_key(args.api_key, args.api_key_file))
        await asyncio.to_thread(generate_main, build_parser().parse_args(request))
    await _serve_forever(server, "coordinator", port, coordinator.stop(), drain=coordinator.drain)
    for worker_server in servers:
        await worker_server.stop(grace=2)


def _generate_args(args: argparse.Namespace, server: str, api_key: str | None) -> list[str]:
    """The `generate` arguments of serve's --generate, through serve's TLS and token."""
    line = ["generate", "--server", server, "--prompt", args.generate]
    if args.tls_ca:
        line += ["--tls-ca", args.tls_ca]
    if args.tls_server_name:
        line += ["--tls-server-name", args.tls_server_name]
    return line + (["--api-key", api_key] if api_key else [])


def serve_main(args: argparse.Namespace) -> int:
    # A shell that starts us in the background leaves SIGINT ignored; Ctrl-C / kill -INT must still stop all three.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        check_stack_tls(args)
        api_key = read_api_key(args.api_key, args.api_key_file)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    taken = ports_taken(args.host, {"--port": args.port, "--http-port": args.http_port})
    if taken:  # before any model loads: the coordinator, started last, would fail only after both had
        print(f"error: {taken}", file=sys.stderr)
        return 1
    if args.api_key:  # the coordinator reads it from its environment: a command line is visible to every user
        os.environ["MINEDRAFT_API_KEY"] = args.api_key
    # All three services read it there: only a coordinator of this stack leases its workers.
    os.environ["MINEDRAFT_LEASE_SECRET"] = args.lease_secret or new_secret()
    if args.single_process:
        with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C during start-up
            _run_until_signal(_single_process_main(args))
        return 0
    processes: list[subprocess.Popen] = []
    terminated: list[bool] = []

    def on_sigterm(signum: int, frame: object) -> None:
        terminated.append(True)
        raise KeyboardInterrupt

    try:
        port = start_stack(args, lambda command: subprocess.Popen(command, start_new_session=True), processes)
        public = f"localhost:{port}"
        print(f"minedraft serving {args.mode} on {public} (target {args.target}, {_drafter(args)})", flush=True)
        if args.http_port:
            scheme = "https" if args.tls_cert else "http"
            print(f"OpenAI-compatible HTTP API on {scheme}://localhost:{args.http_port}/v1", flush=True)
        if args.generate:
            print(f"$ minedraft generate --server {public} --prompt {args.generate!r}", flush=True)
            generate_main(build_parser().parse_args(_generate_args(args, public, api_key)))
            print("serving until Ctrl-C", flush=True)
        signal.signal(signal.SIGTERM, on_sigterm)
        while all(p.poll() is None for p in processes):
            time.sleep(0.5)
        print("a service exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if terminated:  # the coordinator (started last) lets its admitted requests finish first
            drain_process(processes[-1], args.drain_timeout)
        stop_processes(processes)


def generate_main(args: argparse.Namespace) -> int:
    from coordinator.sampling_params import sampling_params
    from minedraft.proto import generation_pb2, generation_pb2_grpc

    params = sampling_params(vars(args))  # the flags named as its fields; an optional one unset where not given
    request = generation_pb2.GenerateRequest(params=params)
    if args.message and args.chat is None:
        print("error: --message needs --chat", file=sys.stderr)
        return 2
    if args.prompt is not None:
        request.prompt = args.prompt
    elif args.chat is not None:
        try:
            request.messages.extend(chat_messages(args.chat, args.message))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            request.prompt_token_ids.extend(int(t) for t in args.prompt_ids.split(",") if t.strip())
        except ValueError:
            print("error: --prompt-ids takes comma-separated integers", file=sys.stderr)
            return 2
    request.n = args.n
    # Per sample (index): token ids, text, finish reason, usage. One sample streams as it comes; several are
    # printed one after another once all have finished (their messages interleave).
    samples: dict[int, list[Any]] = {}
    try:
        tls = client_tls(args.tls_ca, server_name=args.tls_server_name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        with sync_channel(args.server, tls) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for message in stub.Generate(request, timeout=args.timeout, metadata=bearer_metadata(args.api_key)):
                sample = samples.setdefault(message.index, [[], "", 0, None, []])
                sample[0] += message.token_ids
                sample[1] += message.text
                sample[4] += message.logprobs
                if not args.json and args.n <= 1:
                    print(message.text, end="", flush=True)
                if message.finish_reason:
                    sample[2], sample[3] = message.finish_reason, message.usage
    except grpc.RpcError as exc:
        plain = exc.code() == grpc.StatusCode.UNAVAILABLE and not args.tls_ca
        hint = " (if the server serves TLS, pass --tls-ca)" if plain else ""
        print(f"\nerror: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
        return 1
    for index in sorted(samples):
        token_ids, text, finish, usage, logprobs = samples[index]
        if args.json:  # one JSON object a sample, a line each
            out = _generated_json(token_ids, text, finish, usage) | ({"index": index} if args.n > 1 else {})
            if args.logprobs is not None:  # per token: its own, and the top ones as [id, logprob]
                out["logprobs"] = [
                    {"logprob": lp.logprob, "top": [[t.token_id, t.logprob] for t in lp.top]} for lp in logprobs
                ]
            print(json.dumps(out))
        elif args.n > 1:
            print(f"--- sample {index} ---\n{text}")
    if not args.json and args.n <= 1:
        print()
    return 0


def _generated_json(token_ids: list[int], text: str, finish: int, usage: Any) -> dict[str, Any]:
    """`generate --json`'s object of one sample."""
    from minedraft.proto import generation_pb2

    u = usage or generation_pb2.Usage()
    usage_fields: dict[str, Any] = {}
    for field in u.DESCRIPTOR.fields:  # every field of the proto's Usage, as it grows
        value = getattr(u, field.name)
        if not isinstance(value, int | float):  # a repeated field
            value = list(value)
        elif isinstance(value, float):
            value = round(value, 6)
        usage_fields[field.name] = value
    return {
        "token_ids": token_ids,
        "text": text,
        "finish_reason": generation_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower(),
        "usage": usage_fields,
    }


def chat_messages(path: str, messages: Sequence[str]) -> list[generation_pb2.ChatMessage]:
    """`generate --chat`'s messages: those of the JSON file at `path` (a list of {"role", "content"}), or, with no
    path, the --message ROLE:TEXT arguments; ValueError says what is wrong with them."""
    from minedraft.proto import generation_pb2

    if path:
        with open(path, encoding="utf-8") as f:
            given = json.load(f)
        if not isinstance(given, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in given
        ):
            raise ValueError(f'{path}: expected a JSON list of {{"role": ..., "content": ...}} objects')
        pairs = [(m["role"], m["content"]) for m in given]
    else:
        pairs = []
        for message in messages:
            role, colon, text = message.partition(":")
            if not colon or not role.strip():
                raise ValueError(f"--message {message!r}: expected ROLE:TEXT, for example user:Hello")
            pairs.append((role.strip(), text))
    if not pairs:
        raise ValueError("--chat needs messages: --message ROLE:TEXT (repeatable) or a JSON file")
    return [generation_pb2.ChatMessage(role=role, content=content) for role, content in pairs]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve_main(args)
    if args.command == "generate":
        return generate_main(args)
    if args.command == "bench":
        from minedraft_app.bench import bench_main

        return bench_main(args)
    try:
        if args.command in ("target", "draft"):
            _run_until_signal(_worker_main(args, args.command))
        else:
            _run_until_signal(_coordinator_main(args))
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # start-up failures: a message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
