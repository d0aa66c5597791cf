"""Every `minedraft` flag in one table: the parsers, the stack's command lines and docs/cli.md are made from it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing

from coordinator.options import CoordinatorOptions
from minedraft.demo_models import DRAFT_DIR, TARGET_DIR
from minedraft.flag_spec import (
    BATCHES,
    FLAG_KEY,
    MEASUREMENT,
    MODEL_COMMANDS,
    MODELS,
    REQUEST,
    SECTIONS,
    SERVICE,
    SERVICE_COMMANDS,
    STACK_SERVICES,
    STACKS,
    TO_COORDINATOR,
    TO_SERVICES,
    TO_WORKERS,
    WORKERS,
    Flag,
    PassTo,
)
from minedraft.flag_spec import dest as dest  # (for minedraft_app/stack.py)
from minedraft.rpc.options import PRECAPTURE_CHOICES as PRECAPTURE_CHOICES  # (for benchmarks/gpu_bench.py)
from minedraft.rpc.options import WorkerOptions

COMMANDS: dict[str, str] = {
    "serve": "start target, draft and coordinator on this machine",
    "target": "start the target service",
    "draft": "start the draft service",
    "coordinator": "start the coordinator (public API)",
    "generate": "send one request and stream the answer",
    "bench": "measure throughput and latency of a server or of the modes",
}
HELM_COMPONENTS = ("target", "draft", "coordinator")
# What MINEDRAFT_<SWITCH> may read, in any case; empty is off.
SWITCH_VALUES = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off", ""), False)
LOOPBACK = "127.0.0.1"


def option_flags(options: type) -> dict[str, Flag]:
    """Field name -> the Flag that its metadata declares (`minedraft.flag_spec.flag`), with the field's default (None
    where it has none) and the field's type: an int or a float converts the value, a bool is a switch."""
    hints = typing.get_type_hints(options)
    found: dict[str, Flag] = {}
    for field in dataclasses.fields(options):
        if FLAG_KEY in field.metadata:
            hint = hints[field.name]
            kind = next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint)  # X | None: X
            default = None if field.default is dataclasses.MISSING else field.default
            found[field.name] = dataclasses.replace(
                field.metadata[FLAG_KEY],
                default=default,
                type=kind if kind in (int, float) else None,
                switch=kind is bool,
            )
    return found


# The options' flags, each placed in the table below where its --help shows it.
WORKER_FLAGS = option_flags(WorkerOptions)
COORDINATOR_FLAGS = option_flags(CoordinatorOptions)

FLAGS: tuple[Flag, ...] = (
    # ---------------------------------------------------------------- models
    Flag(
        "--target",
        "target model directory, or a .gguf file (dequantized; the gguf extra)",
        STACKS,
        MODELS,
        str(TARGET_DIR),
        passes_to=(
            PassTo("target", "--model"),
            PassTo("coordinator", "--tokenizer"),
            PassTo("draft", "--target-model-for-draft"),
        ),
    ),
    Flag(
        "--draft",
        "draft model directory, or a .gguf file (dequantized; the gguf extra)",
        STACKS,
        MODELS,
        str(DRAFT_DIR),
        passes_to=(PassTo("draft", "--model"),),
    ),
    WORKER_FLAGS["model"],
    Flag("--target-device", "the target's device", STACKS, MODELS, "cpu", passes_to=(PassTo("target", "--device"),)),
    Flag("--draft-device", "the draft's device", STACKS, MODELS, "cpu", passes_to=(PassTo("draft", "--device"),)),
    WORKER_FLAGS["device"],
    WORKER_FLAGS["dtype"],
    Flag(  # WorkerOptions.cuda_graphs is its opposite, so it is declared here (cli.worker_options)
        "--eager",
        "no CUDA graphs (debugging)",
        MODEL_COMMANDS,
        MODELS,
        False,
        switch=True,
        environment=MODEL_COMMANDS,
        passes_to=TO_WORKERS,
    ),
    WORKER_FLAGS["compile_layers"],
    WORKER_FLAGS["deterministic"],
    WORKER_FLAGS["precapture_graphs"],
    WORKER_FLAGS["synthetic_acceptance"],
    WORKER_FLAGS["synthetic_row_acceptance"],
    WORKER_FLAGS["synthetic_rate_by"],
    WORKER_FLAGS["tensor_parallel_size"],
    Flag(
        "--draft-tensor-parallel-size",
        "the draft's --tensor-parallel-size",
        STACKS,
        MODELS,
        1,
        type=int,
        passes_to=(PassTo("draft", "--tensor-parallel-size"),),
    ),
    Flag("--greedy-drafts", "draft greedily even for sampled requests", ("draft",), MODELS, False, switch=True),
    WORKER_FLAGS["target_model_for_draft"],
    WORKER_FLAGS["profile_dir"],
    WORKER_FLAGS["profile_after"],
    # ---------------------------------------------------------------- batches
    COORDINATOR_FLAGS["max_batch_size"],
    WORKER_FLAGS["max_batch_size"],
    WORKER_FLAGS["max_model_len"],
    WORKER_FLAGS["block_size"],
    WORKER_FLAGS["kv_cache_memory"],
    WORKER_FLAGS["gpu_memory_utilization"],
    Flag(  # on/off of WorkerOptions.prefix_caching, declared here (cli.worker_options)
        "--enable-prefix-caching",
        "share the KV blocks of prompts that start alike (on or off)",
        MODEL_COMMANDS,
        BATCHES,
        "on",
        choices=("on", "off"),
        const="on",
        passes_to=TO_WORKERS,
        helm=WORKERS,
    ),
    COORDINATOR_FLAGS["max_queue_size"],
    COORDINATOR_FLAGS["max_prefill_tokens"],
    # ---------------------------------------------------------------- speculation
    COORDINATOR_FLAGS["mode"],
    COORDINATOR_FLAGS["num_speculative_tokens"],
    COORDINATOR_FLAGS["speculation"],
    COORDINATOR_FLAGS["min_speculative_tokens"],
    COORDINATOR_FLAGS["tetris"],
    COORDINATOR_FLAGS["tetris_extra_proposals"],
    COORDINATOR_FLAGS["verify_token_budget"],
    WORKER_FLAGS["speculative_method"],
    WORKER_FLAGS["ngram_min"],
    WORKER_FLAGS["ngram_max"],
    COORDINATOR_FLAGS["overlap"],
    COORDINATOR_FLAGS["channel"],
    COORDINATOR_FLAGS["channel_setup_timeout"],
    COORDINATOR_FLAGS["step_calls"],
    # ---------------------------------------------------------------- service
    COORDINATOR_FLAGS["target"],
    COORDINATOR_FLAGS["draft"],
    COORDINATOR_FLAGS["tokenizer"],
    COORDINATOR_FLAGS["served_model_name"],
    COORDINATOR_FLAGS["tool_call_parser"],
    Flag(
        "--port",
        "port to listen on (0: any free port)",
        SERVICE_COMMANDS,
        SERVICE,
        50051,
        defaults={"target": 0, "draft": 0},
        helps={"serve": "the coordinator's port, the public one (0: any free port)"},
        type=int,
        passes_to=TO_COORDINATOR,
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
        passes_to=TO_COORDINATOR,
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
        passes_to=TO_SERVICES,
    ),
    # Security (docs/design.md, Security): TLS on the public port, mTLS between the coordinator and its workers
    COORDINATOR_FLAGS["tls_cert"],
    WORKER_FLAGS["tls_cert"],
    COORDINATOR_FLAGS["tls_key"],
    WORKER_FLAGS["tls_key"],
    COORDINATOR_FLAGS["tls_ca"],
    WORKER_FLAGS["tls_ca"],
    COORDINATOR_FLAGS["tls_server_name"],
    COORDINATOR_FLAGS["api_key"],
    COORDINATOR_FLAGS["api_key_file"],
    COORDINATOR_FLAGS["http_port"],
    Flag(
        "--port-file",
        "once listening, write the port to this file (for a launcher that passes --port 0)",
        STACK_SERVICES,
        SERVICE,
    ),
    WORKER_FLAGS["drain_timeout"],
    WORKER_FLAGS["lease_timeout"],
    WORKER_FLAGS["lease_secret"],
    COORDINATOR_FLAGS["lease_secret"],
    COORDINATOR_FLAGS["drain_timeout"],
    COORDINATOR_FLAGS["draft_retry_interval"],
    COORDINATOR_FLAGS["draft_timeout"],
    COORDINATOR_FLAGS["target_timeout"],
    COORDINATOR_FLAGS["worker_keepalive"],
    # Limits on one request, checked before any work on it (INVALID_ARGUMENT / HTTP 400 naming the flag)
    COORDINATOR_FLAGS["max_request_bytes"],
    COORDINATOR_FLAGS["max_prompt_bytes"],
    COORDINATOR_FLAGS["max_messages"],
    COORDINATOR_FLAGS["max_stop_strings"],
    COORDINATOR_FLAGS["max_stop_string_bytes"],
    # Connection limits of each public port, gRPC and HTTP apart (docs/design.md, Security)
    COORDINATOR_FLAGS["max_connections"],
    COORDINATOR_FLAGS["header_timeout"],
    COORDINATOR_FLAGS["idle_timeout"],
    COORDINATOR_FLAGS["step_trace"],
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
    Flag(
        "--prompt-kind",
        "corpus: passages of stdlib sources; quote: a passage, then its first third again, so that the text goes on "
        "quoting its own context (code edits, retrieval: what n-gram lookup drafts)",
        ("bench",),
        MEASUREMENT,
        "corpus",
        choices=("corpus", "quote"),
    ),
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
    if flag.nargs is not None:
        return value.split()
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
            if flag.nargs is not None:
                kwargs["nargs"] = flag.nargs
            if flag.const is not None:
                kwargs.update(nargs="?", const=flag.const)
        if flag.required:
            kwargs["required"] = default is None
        group.add_argument(flag.name, **kwargs)  # type: ignore[arg-type]
