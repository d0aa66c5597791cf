"""The `minedraft` command: serve, target, draft, coordinator, generate, bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from minedraft.app.stack import drain_process, start_stack, stop_processes
from minedraft.demo_models import DEMO_DIR

ENV_PREFIX = "MINEDRAFT_"


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _env_default(flag: str, default: object) -> object:
    """Every flag can be set by MINEDRAFT_<FLAG> (the names the Helm chart uses); switches read true/false, 1/0."""
    name = _env_name(flag)
    value = os.environ.get(name)
    if value is None or not isinstance(default, bool):
        return default if value is None else value
    switch = value.strip().lower()
    if switch not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
        raise SystemExit(f"{name}={value!r}: expected true or false")
    return switch in ("1", "true", "yes", "on")


COMPILE_HELP = "torch.compile the decoder layers (fused kernels inside CUDA graphs); compiles at start-up (minutes)"
PRECAPTURE_HELP = (
    "run every batch and key-length shape when a coordinator connects, so CUDA graphs are captured "
    "then and not while requests wait (0.1-0.5 s at each shape's first use); a psd connect takes "
    "about a minute longer on an H200 (8B target, 1B draft). auto: on where CUDA graphs are (a bare "
    "flag means on)"
)
PRECAPTURE_CHOICES = ["auto", "on", "off"]
MAX_PREFILL_TOKENS_HELP = (
    "prompt tokens one step prefills at most (0: no limit; a longer prompt goes alone): a burst "
    "of requests is admitted over several steps, so the first start sooner and running "
    "requests wait less"
)
MIN_SPECULATIVE_TOKENS_HELP = (
    "with --speculation auto, steps may also draft fewer tokens, halving from "
    "--num-speculative-tokens down to this many (each length's CUDA graphs are captured at "
    "start-up), where a shorter draft measures cheaper per token; 0: that many, or none"
)
PORT_FILE_HELP = "once listening, write the port to this file (for a launcher that passes --port 0)"
Arguments = argparse.ArgumentParser | argparse._ArgumentGroup  # a parser, or one of its add_argument_group()s


def _add(parser: Arguments, flag: str, default: object = None, **kwargs: object) -> None:
    value = _env_default(flag, default)
    choices = kwargs.get("choices")
    if choices is not None and value != default and value not in choices:  # type: ignore[operator]
        # argparse checks the choices of values given on the command line only, not of defaults
        raise SystemExit(f"{_env_name(flag)}={value!r}: expected one of {', '.join(map(str, choices))}")  # type: ignore[call-overload]
    parser.add_argument(flag, default=value, **kwargs)  # type: ignore[arg-type]


def add_graph_flags(parser: Arguments) -> None:
    """How a worker runs its model's steps (`serve` and `bench` pass them on to the workers they start)."""
    _add(parser, "--eager", False, action="store_true", help="no CUDA graphs (debugging)")
    _add(parser, "--compile", False, action="store_true", help=COMPILE_HELP)
    _add(parser, "--precapture-graphs", "auto", nargs="?", const="on", choices=PRECAPTURE_CHOICES, help=PRECAPTURE_HELP)


def _worker_flags(parser: argparse.ArgumentParser, default_model: Path) -> None:
    _add(parser, "--model", str(default_model), help="Hugging Face model directory")
    _add(parser, "--port", 0, type=int, help="port to listen on (0: any free port)")
    _add(parser, "--host", "[::]")
    _add(parser, "--device", "cpu", help="cpu, cuda, cuda:1 ...")
    _add(parser, "--dtype", "auto", choices=["auto", "float32", "bfloat16", "float16"])
    _add(parser, "--max-batch-size", 32, type=int, help="sequences per batch (the worker holds two batches)")
    _add(parser, "--max-model-len", 2048, type=int, help="cache length per sequence")
    _add(parser, "--metrics-port", 0, type=int, help="Prometheus /metrics port (0: off)")
    _add(parser, "--port-file", None, help=PORT_FILE_HELP)
    add_graph_flags(parser)
    _add(
        parser,
        "--profile-dir",
        None,
        help="write PyTorch profiler traces of 5 model calls here, after --profile-after calls (diagnosis)",
    )
    _add(parser, "--profile-after", 100, type=int)
    _add(
        parser,
        "--drain-timeout",
        30.0,
        type=float,
        help="on SIGTERM, the most seconds it keeps serving (it stops once no call has come for 5 s: its "
        "coordinator drained); health reports NOT_SERVING meanwhile; SIGINT (Ctrl-C) stops at once",
    )


def _coordinator_flags(parser: argparse.ArgumentParser) -> None:
    _add(parser, "--mode", "psd", choices=["psd", "sd", "ar"])
    _add(parser, "--num-speculative-tokens", 4, type=int)
    _add(parser, "--max-batch-size", 32, type=int)
    _add(parser, "--max-queue-size", 256, type=int)
    _add(parser, "--max-prefill-tokens", 8192, type=int, help=MAX_PREFILL_TOKENS_HELP)
    _add(parser, "--channel", "auto", choices=["auto", "local", "grpc", "cuda-ipc", "nccl"])
    _add(parser, "--step-trace", None, help="write every worker call as JSON lines here on shutdown")
    _add(
        parser,
        "--overlap",
        "auto",
        choices=["auto", "always", "never"],
        help="psd: run Verify and Propose concurrently always, never, or when that measures faster (auto; on a GPU "
        "that target and draft share, auto runs sd on one batch of twice --max-batch-size instead)",
    )
    _add(
        parser,
        "--speculation",
        "auto",
        choices=["auto", "always"],
        help="psd and sd: draft at every step (always), or let the target decode alone while that measures "
        "faster per token than drafting (auto: a large batch, or a draft too slow for its acceptance)",
    )
    _add(parser, "--min-speculative-tokens", 0, type=int, help=MIN_SPECULATIVE_TOKENS_HELP)
    _add(
        parser,
        "--step-calls",
        "stream",
        choices=["stream", "unary"],
        help="how the step's Verify and Propose calls travel: as messages on one open stream per worker "
        "(stream: ~0.5 ms less a call on an H200 host), or as unary calls (unary; a worker without the "
        "streams gets unary calls either way)",
    )
    _add(
        parser,
        "--draft-retry-interval",
        5.0,
        type=float,
        help="seconds between tries to reach a lost draft service again (requests go on with the target alone), "
        "or a lost target service (requests are refused meanwhile)",
    )
    _add(
        parser,
        "--draft-timeout",
        30.0,
        type=float,
        help="seconds a draft call may take before the draft service counts as lost (a hung draft)",
    )
    _add(
        parser,
        "--target-timeout",
        120.0,
        type=float,
        help="seconds a target prefill, verify or release may take before the target service counts as lost (a "
        "hung target: its requests end with UNAVAILABLE until it answers again); 0: no limit",
    )
    _add(
        parser,
        "--drain-timeout",
        30.0,
        type=float,
        help="on SIGTERM, seconds the admitted requests get to finish while health reports NOT_SERVING and new "
        "requests get UNAVAILABLE; SIGINT (Ctrl-C) stops at once",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minedraft", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start target, draft and coordinator on this machine")
    _add(serve, "--target", str(DEMO_DIR / "target"), help="target model directory (default: the demo target)")
    _add(serve, "--draft", str(DEMO_DIR / "draft"), help="draft model directory (default: the demo draft)")
    _add(serve, "--port", 50051, type=int, help="public port")
    _add(serve, "--host", "[::]")
    _add(serve, "--target-device", "cpu")
    _add(serve, "--draft-device", "cpu")
    _add(serve, "--dtype", "auto")
    _add(serve, "--max-model-len", 2048, type=int)
    add_graph_flags(serve)
    _add(serve, "--generate", None, help="once serving, stream the answer to this prompt (then keep serving)")
    _add(
        serve,
        "--single-process",
        False,
        action="store_true",
        help="run target, draft and coordinator in one process (local channel; one GPU, two CUDA streams)",
    )
    _add(
        serve,
        "--metrics-port",
        0,
        type=int,
        help="Prometheus /metrics: coordinator on this port, target on +1, draft on +2 (0: off)",
    )
    _coordinator_flags(serve)

    target = sub.add_parser("target", help="start the target service")
    _worker_flags(target, DEMO_DIR / "target")
    _add(
        target,
        "--synthetic-acceptance",
        None,
        type=float,
        help="BENCHMARK ONLY, not lossless: accept each draft token with this probability",
    )
    draft = sub.add_parser("draft", help="start the draft service")
    _worker_flags(draft, DEMO_DIR / "draft")
    _add(draft, "--greedy-drafts", False, action="store_true", help="draft greedily even for sampled requests")

    coord = sub.add_parser("coordinator", help="start the coordinator (public API)")
    _add(coord, "--target", None, required=_env_default("--target", None) is None, help="target service address")
    _add(coord, "--draft", None, help="draft service address (not needed in ar mode)")
    _add(coord, "--port", 50051, type=int)
    _add(coord, "--host", "[::]")
    _add(coord, "--tokenizer", None, help="tokenizer directory (default: the target's model directory)")
    _add(coord, "--metrics-port", 0, type=int)
    _add(coord, "--port-file", None, help=PORT_FILE_HELP)
    _coordinator_flags(coord)

    gen = sub.add_parser("generate", help="send one request and stream the answer")
    _add(gen, "--server", "localhost:50051")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--timeout", type=float, default=600.0)

    from minedraft.app.bench import add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="measure throughput and latency of a server or of the modes"))
    return parser


def _run_until_signal(main: object) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main)  # type: ignore[arg-type]


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
    from minedraft.rpc.worker import WorkerOptions

    tracing = setup_tracing(f"minedraft-{kind}")
    metrics = WorkerMetrics() if args.metrics_port else None
    if metrics is not None:
        start_metrics_server(args.metrics_port, args.host, metrics.registry)
    interceptors = server_interceptors(tracing, metrics.observe_call if metrics is not None else None)
    options = WorkerOptions(
        args.model,
        args.device,
        args.dtype,
        args.max_batch_size,
        args.max_model_len,
        cuda_graphs=not args.eager,
        compile_layers=args.compile,
        profile_dir=args.profile_dir,
        profile_after=args.profile_after,
        synthetic_acceptance=getattr(args, "synthetic_acceptance", None),
        precapture_graphs=args.precapture_graphs,
        drain_timeout=args.drain_timeout,
    )
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
    from coordinator.server import CoordinatorOptions, serve
    from minedraft.observability.metrics import CoordinatorMetrics, start_metrics_server
    from minedraft.observability.telemetry import setup_tracing

    options = CoordinatorOptions(
        target=args.target,
        draft=args.draft,
        mode=args.mode,
        num_speculative_tokens=args.num_speculative_tokens,
        max_batch_size=args.max_batch_size,
        max_queue_size=args.max_queue_size,
        max_prefill_tokens=args.max_prefill_tokens,
        channel=args.channel,
        tokenizer=args.tokenizer,
        step_trace=args.step_trace,
        overlap=args.overlap,
        speculation=args.speculation,
        min_speculative_tokens=args.min_speculative_tokens,
        step_calls=args.step_calls,
        draft_retry_interval=args.draft_retry_interval,
        draft_timeout=args.draft_timeout,
        target_timeout=args.target_timeout,
        drain_timeout=args.drain_timeout,
    )
    tracing = setup_tracing("minedraft-coordinator")
    metrics = CoordinatorMetrics() if args.metrics_port else None
    if metrics is not None:
        start_metrics_server(args.metrics_port, args.host, metrics.registry)
    try:
        server, port, servicer = await serve(options, args.port, args.host, tracing, metrics)
        await _serve_forever(server, "coordinator", port, servicer.stop(), args.port_file, servicer.drain)
    finally:
        tracing.shutdown()  # export the spans still queued


async def _single_process_main(args: argparse.Namespace) -> None:
    """The whole stack in one process: each worker on its own thread and CUDA stream, drafts over `local`."""
    from coordinator.server import CoordinatorOptions
    from coordinator.server import serve as serve_coordinator
    from draft_service.server import serve as serve_draft
    from minedraft.rpc.worker import WorkerOptions
    from target_service.server import serve as serve_target

    # Two threads with CUDA graphs in one process once hung: every graph was captured on one stream that PyTorch
    # shares across threads. Each runner now captures on its own stream; one-process PSD with graphs ran on one
    # H200 since (docs/benchmarks.md, run 8).
    graphs = not args.eager

    def options(model: str, device: str) -> WorkerOptions:
        return WorkerOptions(
            model,
            device,
            args.dtype,
            args.max_batch_size,
            args.max_model_len,
            graphs,
            args.compile,
            precapture_graphs=args.precapture_graphs,
        )

    servers = []
    server, target_port, _ = await serve_target(options(args.target, args.target_device), 0, "127.0.0.1")
    servers.append(server)
    draft_address = None
    if args.mode != "ar":
        server, draft_port, _ = await serve_draft(options(args.draft, args.draft_device), 0, "127.0.0.1")
        servers.append(server)
        draft_address = f"127.0.0.1:{draft_port}"
    coordinator_options = CoordinatorOptions(
        target=f"127.0.0.1:{target_port}",
        draft=draft_address,
        mode=args.mode,
        num_speculative_tokens=args.num_speculative_tokens,
        max_batch_size=args.max_batch_size,
        max_queue_size=args.max_queue_size,
        max_prefill_tokens=args.max_prefill_tokens,
        channel="local" if args.channel == "auto" else args.channel,
        tokenizer=args.target,
        step_trace=args.step_trace,
        overlap=args.overlap,
        speculation=args.speculation,
        min_speculative_tokens=args.min_speculative_tokens,
        step_calls=args.step_calls,
        draft_retry_interval=args.draft_retry_interval,
        draft_timeout=args.draft_timeout,
        target_timeout=args.target_timeout,
        drain_timeout=args.drain_timeout,
    )
    server, port, servicer = await serve_coordinator(coordinator_options, args.port, args.host)
    print(
        f"minedraft serving {args.mode} on localhost:{port} in one process (target {args.target}, draft {args.draft})",
        flush=True,
    )
    if args.generate:
        request = ["generate", "--server", f"localhost:{port}", "--prompt", args.generate]
        await asyncio.to_thread(generate_main, build_parser().parse_args(request))
    await _serve_forever(server, "coordinator", port, servicer.stop(), drain=servicer.drain)
    for worker_server in servers:
        await worker_server.stop(grace=2)


def serve_main(args: argparse.Namespace) -> int:
    # A shell that starts us in the background leaves SIGINT ignored; Ctrl-C / kill -INT must still stop all three.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
        print(f"minedraft serving {args.mode} on {public} (target {args.target}, draft {args.draft})", flush=True)
        if args.generate:
            print(f"$ minedraft generate --server {public} --prompt {args.generate!r}", flush=True)
            generate_main(build_parser().parse_args(["generate", "--server", public, "--prompt", args.generate]))
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
    from minedraft.proto import generation_pb2, generation_pb2_grpc

    params = generation_pb2.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    if args.seed is not None:
        params.seed = args.seed
    request = generation_pb2.GenerateRequest(params=params)
    if args.prompt is not None:
        request.prompt = args.prompt
    else:
        try:
            request.prompt_token_ids.extend(int(t) for t in args.prompt_ids.split(",") if t.strip())
        except ValueError:
            print("error: --prompt-ids takes comma-separated integers", file=sys.stderr)
            return 2
    token_ids: list[int] = []
    text, finish, usage = "", 0, None
    try:
        with grpc.insecure_channel(args.server) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            for message in stub.Generate(request, timeout=args.timeout):
                token_ids += message.token_ids
                text += message.text
                if not args.json:
                    print(message.text, end="", flush=True)
                if message.finish_reason:
                    finish, usage = message.finish_reason, message.usage
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if args.json:
        u = usage or generation_pb2.Usage()
        print(
            json.dumps(
                {
                    "token_ids": token_ids,
                    "text": text,
                    "finish_reason": generation_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower(),
                    "usage": {
                        "prompt_tokens": u.prompt_tokens,
                        "completion_tokens": u.completion_tokens,
                        "draft_tokens": u.draft_tokens,
                        "accepted_tokens": u.accepted_tokens,
                        "steps": u.steps,
                        "drafted_steps": u.drafted_steps,
                        "mean_accepted_length": round(u.mean_accepted_length, 4),
                        "acceptance_rate": round(u.acceptance_rate, 4),
                        "accepted_per_position": list(u.accepted_per_position),
                        "time_to_first_token_s": round(u.time_to_first_token_s, 6),
                        "time_per_output_token_s": round(u.time_per_output_token_s, 6),
                    },
                }
            )
        )
    else:
        print()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve_main(args)
    if args.command == "generate":
        return generate_main(args)
    if args.command == "bench":
        from minedraft.app.bench import bench_main

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
