"""Every `minedraft` flag, declared once: the parsers, the stack's command lines and docs/cli.md are made from it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from minedraft.demo_models import DRAFT_DIR, TARGET_DIR

COMMANDS: dict[str, str] = {
    "serve": "start target, draft and coordinator on this machine",
    "target": "start the target service",
    "draft": "start the draft service",
    "coordinator": "start the coordinator (public API)",
    "generate": "send one request and stream the answer",
    "bench": "measure throughput and latency of a server or of the modes",
}
SERVICE_COMMANDS = ("serve", "target", "draft", "coordinator")  # MINEDRAFT_<FLAG> sets their flags
STACK_SERVICES = ("target", "draft", "coordinator")  # what `serve` and `bench --modes` start
HELM_COMPONENTS = ("target", "draft", "coordinator")
ENV_PREFIX = "MINEDRAFT_"
# What MINEDRAFT_<SWITCH> may read, in any case; empty is off.
SWITCH_VALUES = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off", ""), False)
PRECAPTURE_CHOICES = ("auto", "on", "off")
LOOPBACK = "127.0.0.1"


def dest(name: str) -> str:
    """The attribute a flag's value lands in: --max-batch-size -> max_batch_size."""
    return name.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Flag:
    """One flag of one or more commands; a name means one thing in the commands that share an entry."""

    name: str
    help: str
    commands: tuple[str, ...]
    section: str
    default: object = None
    defaults: Mapping[str, object] = field(default_factory=dict)  # a command's own default, where it differs
    helps: Mapping[str, str] = field(default_factory=dict)  # a command's own help, where it differs
    type: Callable[[str], object] | None = None
    choices: tuple[str, ...] | None = None
    switch: bool = False  # given bare, it sets True
    const: str | None = None  # the value when given bare (its value is optional)
    repeat: bool = False  # each use adds a value to a list, empty by default
    required: bool = False  # unless its environment variable is set
    one_of: str | None = None  # exactly one flag of each one_of group must be given
    environment: tuple[str, ...] | None = None  # commands where MINEDRAFT_<FLAG> sets it; None: the services'
    passes_to: tuple[str, ...] = ()  # what a serve/bench stack sets from it: "SERVICE" or "SERVICE --ITS-FLAG"
    helm: tuple[str, ...] = ()  # chart components whose value <component>.<helm_key> sets MINEDRAFT_<FLAG>

    @property
    def dest(self) -> str:
        return dest(self.name)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def helm_key(self) -> str:
        first, *rest = self.dest.split("_")
        return first + "".join(word.capitalize() for word in rest)

    @property
    def passed_on(self) -> dict[str, str]:
        """Service -> the flag of that service which a serve/bench stack gives this flag's value."""
        services = {}
        for entry in self.passes_to:
            service, _, name = entry.partition(" ")
            services[service] = name or self.name
        return services

    def default_in(self, command: str) -> object:
        return self.defaults.get(command, self.default)

    def help_in(self, command: str) -> str:
        return self.helps.get(command, self.help)

    def reads_env(self, command: str) -> bool:
        commands = self.environment if self.environment is not None else SERVICE_COMMANDS
        return command in commands


# The sections of a command's --help, in this order.
MEASUREMENT = "measurement"
REQUEST = "request"
MODELS = "models"
BATCHES = "batches"
SPECULATION = "speculation"
SERVICE = "service"
SECTIONS = (MEASUREMENT, REQUEST, MODELS, BATCHES, SPECULATION, SERVICE)

WORKERS = ("target", "draft")
STACKS = ("serve", "bench")
MODEL_COMMANDS = ("serve", "target", "draft", "bench")  # those that load models, or start services that do
POLICY_COMMANDS = ("serve", "coordinator", "bench")  # the coordinator's step policy, also set by a bench stack
COORDINATOR_COMMANDS = ("serve", "coordinator")

FLAGS: tuple[Flag, ...] = (
    # ---------------------------------------------------------------- models
    Flag(
        "--target",
        "target model directory",
        STACKS,
        MODELS,
        str(TARGET_DIR),
        passes_to=("target --model", "coordinator --tokenizer"),
    ),
    Flag(
        "--draft",
        "draft model directory",
        STACKS,
        MODELS,
        str(DRAFT_DIR),
        passes_to=("draft --model",),
    ),
    Flag(
        "--model",
        "Hugging Face model directory",
        WORKERS,
        MODELS,
        defaults={"target": str(TARGET_DIR), "draft": str(DRAFT_DIR)},
        helm=WORKERS,
    ),
    Flag("--target-device", "the target's device", STACKS, MODELS, "cpu", passes_to=("target --device",)),
    Flag("--draft-device", "the draft's device", STACKS, MODELS, "cpu", passes_to=("draft --device",)),
    Flag("--device", "cpu, cuda, cuda:1 ...", WORKERS, MODELS, "cpu", helm=WORKERS),
    Flag(
        "--dtype",
        "the models' dtype (auto: bfloat16 on a GPU, float32 on a CPU)",
        MODEL_COMMANDS,
        MODELS,
        "auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--eager",
        "no CUDA graphs (debugging)",
        MODEL_COMMANDS,
        MODELS,
        False,
        switch=True,
        environment=MODEL_COMMANDS,
        passes_to=WORKERS,
    ),
    Flag(
        "--compile",
        "torch.compile the decoder layers (fused kernels inside the CUDA graphs); compiling at start-up takes minutes",
        MODEL_COMMANDS,
        MODELS,
        False,
        switch=True,
        environment=MODEL_COMMANDS,
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--precapture-graphs",
        "run every batch and key-length shape when a coordinator connects, so that CUDA graphs are captured then, "
        "not while requests wait; auto: where CUDA graphs are (the bare flag means on)",
        MODEL_COMMANDS,
        MODELS,
        "auto",
        choices=PRECAPTURE_CHOICES,
        const="on",
        environment=MODEL_COMMANDS,
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--synthetic-acceptance",
        "BENCHMARK ONLY, not lossless: the target accepts each draft token with this probability",
        ("target", "bench"),
        MODELS,
        type=float,
        passes_to=("target",),
    ),
    Flag(
        "--tensor-parallel-size",
        "shard the model over this many ranks, one process per device (the next GPUs after --device's; gloo on a "
        "CPU): attention heads and MLP columns split, two all-reduces per layer; rank 0 serves",
        ("target", "draft", "serve", "bench"),
        MODELS,
        1,
        type=int,
        helps={s: "the target's --tensor-parallel-size" for s in STACKS},
        passes_to=("target",),
    ),
    Flag(
        "--draft-tensor-parallel-size",
        "the draft's --tensor-parallel-size",
        STACKS,
        MODELS,
        1,
        type=int,
        passes_to=("draft --tensor-parallel-size",),
    ),
    Flag("--greedy-drafts", "draft greedily even for sampled requests", ("draft",), MODELS, False, switch=True),
    Flag(
        "--profile-dir",
        "write PyTorch profiler traces of 5 model calls here, after --profile-after calls (diagnosis)",
        WORKERS,
        MODELS,
    ),
    Flag("--profile-after", "model calls before the profiled ones", WORKERS, MODELS, 100, type=int),
    # ---------------------------------------------------------------- batches
    Flag(
        "--max-batch-size",
        "sequences per batch (psd runs two batches, so a worker holds twice as many)",
        ("serve", "target", "draft", "coordinator", "bench"),
        BATCHES,
        32,
        defaults={"bench": 8},
        type=int,
        passes_to=STACK_SERVICES,
        helm=HELM_COMPONENTS,
    ),
    Flag(
        "--max-model-len",
        "tokens per sequence, prompt and output (default: the model's context, lowered to what the KV cache holds)",
        MODEL_COMMANDS,
        BATCHES,
        None,
        helps={"bench": "tokens per sequence (default: room for --prompt-len and --output-len)"},
        type=int,
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--block-size",
        "tokens per KV cache block",
        MODEL_COMMANDS,
        BATCHES,
        16,
        type=int,
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--kv-cache-memory",
        "GiB of KV cache blocks per worker, allocated at start-up (default: by --gpu-memory-utilization on a GPU, "
        "1 GiB on a CPU)",
        MODEL_COMMANDS,
        BATCHES,
        None,
        type=float,
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--gpu-memory-utilization",
        "the fraction of its GPU's memory a worker may use, weights, graphs and KV cache included",
        MODEL_COMMANDS,
        BATCHES,
        0.9,
        type=float,
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--enable-prefix-caching",
        "share the KV blocks of prompts that start alike (on or off)",
        MODEL_COMMANDS,
        BATCHES,
        "on",
        choices=("on", "off"),
        const="on",
        passes_to=WORKERS,
        helm=WORKERS,
    ),
    Flag(
        "--max-queue-size",
        "requests that may wait for a batch; more are refused until some start",
        COORDINATOR_COMMANDS,
        BATCHES,
        256,
        type=int,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--max-prefill-tokens",
        "prompt tokens one step prefills at most (0: no limit; a longer prompt goes alone), so that a burst of "
        "requests is admitted over several steps",
        POLICY_COMMANDS,
        BATCHES,
        8192,
        defaults={"bench": None},
        helps={"bench": "the coordinators' --max-prefill-tokens (default: theirs)"},
        type=int,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    # ---------------------------------------------------------------- speculation
    Flag(
        "--mode",
        "psd: draft one batch while the other is verified; sd: draft, then verify; ar: the target alone",
        COORDINATOR_COMMANDS,
        SPECULATION,
        "psd",
        choices=("psd", "sd", "ar"),
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--num-speculative-tokens",
        "tokens the draft proposes per step (k)",
        POLICY_COMMANDS,
        SPECULATION,
        4,
        type=int,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--speculation",
        "psd and sd: draft at every step (always), or let the target decode alone while that measures faster per "
        "token than drafting (auto)",
        POLICY_COMMANDS,
        SPECULATION,
        "auto",
        choices=("auto", "always"),
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--min-speculative-tokens",
        "with --speculation auto, steps may also draft fewer tokens, halving from --num-speculative-tokens down to "
        "this many, where that measures cheaper per token (0: all of them, or none)",
        POLICY_COMMANDS,
        SPECULATION,
        0,
        type=int,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--overlap",
        "psd: run Verify and Propose concurrently always, never, or where that measures faster (auto; on a GPU "
        "that target and draft share, auto runs sd on one batch of twice --max-batch-size)",
        POLICY_COMMANDS,
        SPECULATION,
        "auto",
        choices=("auto", "always", "never"),
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--channel",
        "how drafts reach the target: auto picks cuda-ipc between GPUs of one host, nccl between other GPUs and "
        "grpc otherwise (serve --single-process: local)",
        POLICY_COMMANDS,
        SPECULATION,
        "auto",
        choices=("auto", "local", "grpc", "cuda-ipc", "nccl"),
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--step-calls",
        "how Verify and Propose travel: as messages on one open stream per worker (stream: ~0.5 ms less a call on "
        "an H200 host), or as unary calls, which a worker without the streams gets either way",
        COORDINATOR_COMMANDS,
        SPECULATION,
        "stream",
        choices=("stream", "unary"),
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    # ---------------------------------------------------------------- service
    Flag("--target", "target service address", ("coordinator",), SERVICE, required=True),
    Flag("--draft", "draft service address (not needed in ar mode)", ("coordinator",), SERVICE),
    Flag(
        "--tokenizer",
        "tokenizer directory for text prompts (default: the target's model directory)",
        ("coordinator",),
        SERVICE,
        helm=("coordinator",),
    ),
    Flag(
        "--port",
        "port to listen on (0: any free port)",
        SERVICE_COMMANDS,
        SERVICE,
        50051,
        defaults={"target": 0, "draft": 0},
        helps={"serve": "the coordinator's port, the public one (0: any free port)"},
        type=int,
        passes_to=("coordinator",),
        helm=HELM_COMPONENTS,
    ),
    Flag(
        "--host",
        "address to listen on: the public port's, every interface by default ([::], IPv4 too)",
        SERVICE_COMMANDS,
        SERVICE,
        "[::]",
        defaults={"target": LOOPBACK, "draft": LOOPBACK},
        helps={
            "serve": "the coordinator's address to listen on, every interface by default (the workers listen on "
            "127.0.0.1)",
            "target": "address to listen on: loopback by default, as only the coordinator calls a worker ([::]: "
            "every interface, for a coordinator on another host)",
            "draft": "address to listen on: loopback by default, as only the coordinator calls a worker ([::]: "
            "every interface, for a coordinator on another host)",
        },
        passes_to=("coordinator",),
    ),
    Flag(
        "--metrics-port",
        "Prometheus /metrics port (0: off)",
        SERVICE_COMMANDS,
        SERVICE,
        0,
        helps={
            "serve": "the coordinator's Prometheus /metrics port (0: off); the target's is the next, the draft's after"
        },
        type=int,
    ),
    Flag(
        "--metrics-host",
        "address the /metrics port listens on (default: 127.0.0.1, not the public --host; [::] for a scraper on "
        "another host)",
        SERVICE_COMMANDS,
        SERVICE,
        helps={
            "target": "address the /metrics port listens on (default: --host, itself loopback by default)",
            "draft": "address the /metrics port listens on (default: --host, itself loopback by default)",
            "serve": "address the services' /metrics ports listen on (default: 127.0.0.1)",
        },
        passes_to=STACK_SERVICES,
    ),
    # Security (docs/design.md, Security): TLS on the public port, mTLS between the coordinator and its workers
    Flag(
        "--tls-cert",
        "PEM certificate (chain) of this server: with --tls-key, the public gRPC and HTTP ports serve TLS only; "
        "with --tls-ca it is also the client certificate the coordinator presents to its workers",
        COORDINATOR_COMMANDS,
        SERVICE,
        helps={
            "serve": "PEM certificate the services serve TLS with (the coordinator's public ports too; needs "
            "--tls-ca, with which they check each other)",
        },
        passes_to=STACK_SERVICES,
    ),
    Flag(
        "--tls-cert",
        "PEM certificate of this worker: with --tls-key and --tls-ca, it serves mTLS only",
        WORKERS,
        SERVICE,
    ),
    Flag(
        "--tls-key",
        "PEM private key of --tls-cert",
        SERVICE_COMMANDS,
        SERVICE,
        passes_to=STACK_SERVICES,
    ),
    Flag(
        "--tls-ca",
        "PEM CA certificate(s) of the mTLS between the coordinator and its workers: the coordinator dials its "
        "workers over TLS, checking their certificates with it and presenting its own --tls-cert",
        COORDINATOR_COMMANDS,
        SERVICE,
        helps={"serve": "PEM CA certificate(s) that signed --tls-cert: the services talk mTLS with each other"},
        passes_to=STACK_SERVICES,
    ),
    Flag(
        "--tls-ca",
        "PEM CA certificate(s) of the mTLS with the coordinator: with --tls-cert and --tls-key the worker refuses "
        "a client without a certificate that this CA signed",
        WORKERS,
        SERVICE,
    ),
    Flag(
        "--tls-server-name",
        "the name the workers' certificates are checked against, where it is not the host of --target/--draft",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=("coordinator",),
    ),
    Flag(
        "--api-key",
        "bearer token that every call to the public APIs must carry (gRPC metadata `authorization: Bearer KEY`, "
        "HTTP header `Authorization: Bearer KEY`; health and reflection stay open); prefer --api-key-file or "
        "MINEDRAFT_API_KEY to keep it out of the process list",
        COORDINATOR_COMMANDS,
        SERVICE,
        helps={
            "serve": "the coordinator's --api-key, which it gets through MINEDRAFT_API_KEY in its environment (never "
            "on its command line); serve --generate sends it"
        },
        environment=COORDINATOR_COMMANDS,
    ),
    Flag(
        "--api-key-file",
        "file whose first line is the --api-key",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=("coordinator",),
    ),
    Flag(
        "--http-port",
        "port of the OpenAI-compatible HTTP API beside the gRPC one (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health), on --host (0: off)",
        ("serve", "coordinator", "bench"),
        SERVICE,
        8000,
        defaults={"bench": 0},
        helps={"bench": "the OpenAI-compatible HTTP port of the coordinators it starts (0: off)"},
        type=int,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--port-file",
        "once listening, write the port to this file (for a launcher that passes --port 0)",
        STACK_SERVICES,
        SERVICE,
    ),
    Flag(
        "--drain-timeout",
        "on SIGTERM, the most seconds it keeps serving, reporting NOT_SERVING; it stops sooner once no call has come "
        "for 5 s (its coordinator drained); SIGINT (Ctrl-C) stops at once",
        WORKERS,
        SERVICE,
        30.0,
        type=float,
    ),
    Flag(
        "--lease-timeout",
        "seconds a coordinator's lease on this worker lasts without a renewal (its calls and heartbeats renew it): "
        "after that the worker frees what the coordinator held and takes another; until then a second coordinator "
        "is refused",
        ("serve", *WORKERS),
        SERVICE,
        5.0,
        type=float,
        passes_to=WORKERS,
    ),
    Flag(
        "--lease-secret",
        "secret the coordinator presents with its lease on each worker; a worker started with one leases to no "
        "coordinator without it (give the same to both; prefer MINEDRAFT_LEASE_SECRET, out of the process list). "
        "Without it a coordinator makes a random one, which keeps a process that reads its errors from taking its "
        "lease but not from taking a free worker: split deployments set one, or mTLS",
        SERVICE_COMMANDS,
        SERVICE,
        helps={
            "serve": "the services' --lease-secret, through MINEDRAFT_LEASE_SECRET in their environment; serve makes a "
            "random one when none is given",
        },
    ),
    Flag(
        "--drain-timeout",
        "on SIGTERM, seconds the admitted requests get to finish while health reports NOT_SERVING and new requests "
        "get UNAVAILABLE; SIGINT (Ctrl-C) stops at once",
        COORDINATOR_COMMANDS,
        SERVICE,
        30.0,
        type=float,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--draft-retry-interval",
        "seconds between tries to reach a lost draft service (requests go on with the target alone) or a lost "
        "target service (requests are refused meanwhile)",
        COORDINATOR_COMMANDS,
        SERVICE,
        5.0,
        type=float,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--draft-timeout",
        "seconds a draft call may take before the draft service counts as lost (a hung draft); a proposal's own "
        "deadline is 20x the median proposal time (at least 1 s) when that is shorter",
        COORDINATOR_COMMANDS,
        SERVICE,
        30.0,
        type=float,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    Flag(
        "--target-timeout",
        "seconds a target prefill, verify or release may take before the target service counts as lost and its "
        "requests end with UNAVAILABLE until it answers again (0: no limit); a verify's own deadline is 20x the "
        "median verify time (at least 10 s) when that is shorter",
        COORDINATOR_COMMANDS,
        SERVICE,
        120.0,
        type=float,
        passes_to=("coordinator",),
        helm=("coordinator",),
    ),
    # Limits on one request, checked before any work on it (INVALID_ARGUMENT / HTTP 400 naming the flag)
    Flag(
        "--max-request-bytes",
        "largest request the public APIs take, in bytes: a gRPC message (larger: RESOURCE_EXHAUSTED, unread) or an "
        "HTTP body (larger: 400, read no further)",
        COORDINATOR_COMMANDS,
        SERVICE,
        4 << 20,
        type=int,
        passes_to=("coordinator",),
    ),
    Flag(
        "--max-prompt-bytes",
        "largest prompt text, or chat messages in all, in UTF-8 bytes (checked before tokenizing)",
        COORDINATOR_COMMANDS,
        SERVICE,
        1 << 20,
        type=int,
        passes_to=("coordinator",),
    ),
    Flag(
        "--max-messages",
        "most chat messages one request may hold",
        COORDINATOR_COMMANDS,
        SERVICE,
        1024,
        type=int,
        passes_to=("coordinator",),
    ),
    Flag(
        "--max-stop-strings",
        "most stop strings one request may give",
        COORDINATOR_COMMANDS,
        SERVICE,
        16,
        type=int,
        passes_to=("coordinator",),
    ),
    Flag(
        "--max-stop-string-bytes",
        "longest stop string, in UTF-8 bytes",
        COORDINATOR_COMMANDS,
        SERVICE,
        256,
        type=int,
        passes_to=("coordinator",),
    ),
    # Connection limits of each public port, gRPC and HTTP apart (docs/design.md, Security)
    Flag(
        "--max-connections",
        "most connections open at once on each public port (gRPC, HTTP): beyond, a new one is refused at once (HTTP "
        "first shuts the one waiting longest for a request); lowered to fit the open-files limit",
        COORDINATOR_COMMANDS,
        SERVICE,
        1024,
        type=int,
        passes_to=("coordinator",),
    ),
    Flag(
        "--header-timeout",
        "seconds a new connection has to send its request's headers (HTTP) or finish its TLS and HTTP/2 handshake "
        "(gRPC) before it is closed",
        COORDINATOR_COMMANDS,
        SERVICE,
        10.0,
        type=float,
        passes_to=("coordinator",),
    ),
    Flag(
        "--idle-timeout",
        "seconds a connection may stay open without a call (gRPC) or between requests (HTTP keep-alive) before it "
        "is closed",
        COORDINATOR_COMMANDS,
        SERVICE,
        60.0,
        type=float,
        passes_to=("coordinator",),
    ),
    Flag(
        "--step-trace",
        "on shutdown, write every worker call to this file as JSON lines",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=("coordinator",),
    ),
    Flag(
        "--single-process",
        "run target, draft and coordinator in one process (local channel; on one GPU, a CUDA stream each)",
        ("serve",),
        SERVICE,
        False,
        switch=True,
    ),
    Flag("--generate", "once serving, stream the answer to this prompt (then keep serving)", ("serve",), SERVICE),
    # ---------------------------------------------------------------- a request
    Flag(
        "--server",
        "address of the server",
        ("generate", "bench"),
        REQUEST,
        "localhost:50051",
        defaults={"bench": None},
        helps={"bench": "address of a running server to measure (default without --modes: localhost:50051)"},
        environment=("generate",),
    ),
    Flag("--prompt", "the prompt, as text", ("generate",), REQUEST, one_of="prompt"),
    Flag("--prompt-ids", "the prompt, as comma-separated token ids", ("generate",), REQUEST, one_of="prompt"),
    Flag(
        "--chat",
        "send chat messages, which the server formats with the model's chat template: those of --message, or "
        'those of this JSON file ([{"role": "user", "content": "..."}, ...])',
        ("generate",),
        REQUEST,
        const="",
        one_of="prompt",
    ),
    Flag(
        "--message",
        "with --chat: a message as ROLE:TEXT, for example user:Hello (repeatable, in order)",
        ("generate",),
        REQUEST,
        repeat=True,
    ),
    Flag("--max-tokens", "tokens to generate at most", ("generate",), REQUEST, 64, type=int),
    Flag(
        "--n",
        "completions (samples) of the prompt to generate, printed one after another (sample i is seeded with "
        "--seed + i)",
        ("generate",),
        REQUEST,
        1,
        type=int,
    ),
    Flag("--temperature", "sampling temperature (0: greedy)", ("generate", "bench"), REQUEST, 0.0, type=float),
    Flag(
        "--top-p",
        "sample among the likeliest tokens whose probabilities add up to this (1: all)",
        ("generate", "bench"),
        REQUEST,
        1.0,
        type=float,
    ),
    Flag("--top-k", "sample among the k likeliest tokens (0: all)", ("generate", "bench"), REQUEST, 0, type=int),
    Flag(
        "--seed",
        "sampling seed",
        ("generate", "bench"),
        REQUEST,
        defaults={"bench": 0},
        helps={"bench": "picks the prompts, and seeds the sampling of request i with seed + i"},
        type=int,
    ),
    Flag(
        "--min-tokens",
        "tokens to generate at least (EOS and stop ids held back until then)",
        ("generate",),
        REQUEST,
        0,
        type=int,
    ),
    Flag(
        "--min-p",
        "drop tokens below this times the likeliest token's probability (0: off)",
        ("generate",),
        REQUEST,
        0.0,
        type=float,
    ),
    Flag(
        "--repetition-penalty",
        "Hugging Face's repetition penalty over prompt and output tokens (1: off)",
        ("generate",),
        REQUEST,
        type=float,
    ),
    Flag(
        "--presence-penalty", "OpenAI's presence penalty, in [-2, 2] (0: off)", ("generate",), REQUEST, 0.0, type=float
    ),
    Flag(
        "--frequency-penalty",
        "OpenAI's frequency penalty, in [-2, 2] (0: off)",
        ("generate",),
        REQUEST,
        0.0,
        type=float,
    ),
    Flag(
        "--logprobs",
        "with --json: each token's log-probability and those of the N likeliest tokens (0: its own only)",
        ("generate",),
        REQUEST,
        type=int,
    ),
    Flag("--stop", "stop string (repeatable)", ("generate",), REQUEST, repeat=True),
    Flag("--ignore-eos", "generate past the end-of-sequence token", ("generate",), REQUEST, False, switch=True),
    Flag("--json", "print one JSON object instead of streaming text", ("generate",), REQUEST, False, switch=True),
    Flag("--timeout", "deadline of each request, in seconds", ("generate", "bench"), REQUEST, 600.0, type=float),
    Flag(
        "--api-key",
        "the server's bearer token (its --api-key), sent with each request",
        ("generate", "bench"),
        REQUEST,
        environment=("generate", "bench"),
    ),
    Flag(
        "--tls-ca",
        "PEM CA certificate(s) that signed the server's certificate: connect over TLS, checking it with them",
        ("generate", "bench"),
        REQUEST,
    ),
    Flag(
        "--tls-server-name",
        "with --tls-ca: the name the server's certificate is checked against, where it is not the host of --server",
        ("generate", "bench"),
        REQUEST,
    ),
    # ---------------------------------------------------------------- what bench measures, and how
    Flag(
        "--modes",
        "comma-separated modes among psd, sd, ar, sd2b (sd with one batch of 2 x --max-batch-size) and sddp (sd on "
        "two independent stacks, one on --target-device and one on --draft-device, the load's streams split between "
        "them: data parallel): start a local stack per mode, one after the other, on the same load",
        ("bench",),
        MEASUREMENT,
    ),
    Flag(
        "--sd-batch-equal-concurrency",
        "with --modes: also run sd at the same total concurrency as psd (adds sd2b)",
        ("bench",),
        MEASUREMENT,
        False,
        switch=True,
    ),
    Flag(
        "--api",
        "the API the load goes through: grpc (Generate streams) or http (streamed /v1/completions of the "
        "OpenAI-compatible API, through the openai client; --server is then its address, default localhost:8000, "
        "and stacks of --modes serve it on a free port)",
        ("bench",),
        MEASUREMENT,
        "grpc",
        choices=("grpc", "http"),
    ),
    Flag("--num-prompts", "requests measured", ("bench",), MEASUREMENT, 64, type=int),
    Flag(
        "--concurrency",
        "requests in flight at once (default: 2 x --max-batch-size, both psd batches full)",
        ("bench",),
        MEASUREMENT,
        type=int,
    ),
    Flag("--prompt-len", "prompt length in tokens (about, without a tokenizer)", ("bench",), MEASUREMENT, 64, type=int),
    Flag("--output-len", "tokens generated per request (EOS is ignored)", ("bench",), MEASUREMENT, 64, type=int),
    Flag("--num-warmup", "requests sent (and not measured) before the load", ("bench",), MEASUREMENT, 2, type=int),
    Flag(
        "--tokenizer",
        "tokenizer directory that cuts prompts of --prompt-len tokens (default: the target model directory, when "
        "it is on this machine)",
        ("bench",),
        MEASUREMENT,
    ),
    Flag(
        "--threads",
        "OMP_NUM_THREADS of the services it starts (on a CPU, 1 keeps three services from oversubscribing a small "
        "machine)",
        ("bench",),
        MEASUREMENT,
        type=int,
    ),
    Flag("--step-trace-dir", "write each mode's coordinator step trace to DIR/MODE.jsonl", ("bench",), MEASUREMENT),
    Flag("--log-dir", "where the services' logs go (default: a temporary folder)", ("bench",), MEASUREMENT),
    Flag("--json-out", "also write the results as JSON to this file", ("bench",), MEASUREMENT),
    Flag("--no-progress", "no progress bar", ("bench",), MEASUREMENT, False, switch=True),
)


def flags_of(command: str) -> list[Flag]:
    """The flags of `command`, section by section."""
    return sorted((flag for flag in FLAGS if command in flag.commands), key=lambda flag: SECTIONS.index(flag.section))


def env_default(flag: Flag, command: str) -> object:
    """The flag's default in `command`, or MINEDRAFT_<FLAG> where that sets it (a switch reads true/false, 1/0)."""
    default = flag.default_in(command)
    value = os.environ.get(flag.env) if flag.reads_env(command) else None
    if value is None:
        return default
    if flag.switch:
        switch = value.strip().lower()
        if switch not in SWITCH_VALUES:
            raise SystemExit(f"{flag.env}={value!r}: expected true or false")
        return SWITCH_VALUES[switch]
    if flag.choices is not None and value not in flag.choices:  # argparse checks given values only, not defaults
        raise SystemExit(f"{flag.env}={value!r}: expected one of {', '.join(flag.choices)}")
    return value  # argparse converts a default that is a string with the flag's type


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Declare the flags of `command` on its parser, one argument group per section."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    one_of: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for flag in flags_of(command):
        if flag.section not in sections:
            sections[flag.section] = parser.add_argument_group(flag.section)
        group: argparse._ArgumentGroup = sections[flag.section]
        if flag.one_of is not None:
            if flag.one_of not in one_of:
                one_of[flag.one_of] = group.add_mutually_exclusive_group(required=True)
            group = one_of[flag.one_of]
        default = env_default(flag, command)
        kwargs: dict[str, object] = {"default": default, "help": flag.help_in(command).replace("%", "%%")}
        if flag.switch:
            kwargs["action"] = "store_true"
        elif flag.repeat:
            kwargs.update(action="append", default=[])
        else:
            kwargs.update(type=flag.type, choices=flag.choices)
            if flag.const is not None:
                kwargs.update(nargs="?", const=flag.const)
        if flag.required:
            kwargs["required"] = default is None
        group.add_argument(flag.name, **kwargs)  # type: ignore[arg-type]
