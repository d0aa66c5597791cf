"""The coordinator's options: what `minedraft coordinator` and `serve` configure it with, and their flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minedraft.flag_spec import (
    BATCHES,
    COORDINATOR_COMMANDS,
    FLAG_KEY,
    LEASE_SECRET_HELP,
    POLICY_COMMANDS,
    SERVICE,
    SPECULATION,
    TO_COORDINATOR,
    TO_SERVICES,
    Flag,
    flag,
)

if TYPE_CHECKING:
    from coordinator.validation import Limits

_ONLY_COORDINATOR = ("coordinator",)


@dataclass(kw_only=True)
class PublicPortOptions:
    """What the public ports take and whom they trust: request limits, connection limits, TLS, the API key and the
    lease secret (`CoordinatorOptions` holds them too). Each field with a flag is set by it; its default is the
    flag's."""

    # Limits on one request, checked before any work on it (`coordinator.validation.Limits`; INVALID_ARGUMENT / HTTP
    # 400 naming the flag)
    max_request_bytes: int = flag(  # the public gRPC server's receive limit
        4 << 20,
        "--max-request-bytes",
        "largest request the public APIs take, in bytes: a gRPC message (larger: RESOURCE_EXHAUSTED, unread) or an "
        "HTTP body (larger: 400, read no further)",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    max_prompt_bytes: int = flag(
        1 << 20,
        "--max-prompt-bytes",
        "largest prompt text, or chat messages in all, in UTF-8 bytes (checked before tokenizing)",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    max_messages: int = flag(
        1024,
        "--max-messages",
        "most chat messages one request may hold",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    max_stop_strings: int = flag(
        16,
        "--max-stop-strings",
        "most stop strings one request may give",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    max_stop_string_bytes: int = flag(
        256,
        "--max-stop-string-bytes",
        "longest stop string, in UTF-8 bytes",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    # Security (`minedraft.rpc.security`, docs/design.md): TLS on the public port (gRPC and HTTP) from this
    # certificate and key, which are also its client certificate to workers verified with `tls_ca` (mTLS); the
    # bearer token of the public APIs, given or in a file.
    tls_cert: str | None = flag(
        None,
        "--tls-cert",
        "PEM certificate (chain) of this server: with --tls-key, the public gRPC and HTTP ports serve TLS only; "
        "with --tls-ca it is also the client certificate the coordinator presents to its workers",
        COORDINATOR_COMMANDS,
        SERVICE,
        helps={
            "serve": "PEM certificate the services serve TLS with (the coordinator's public ports too; needs "
            "--tls-ca, with which they check each other)",
        },
        passes_to=TO_SERVICES,
    )
    # serve's, which it passes on to the workers too (WorkerOptions has the workers' own)
    tls_key: str | None = flag(
        None, "--tls-key", "PEM private key of --tls-cert", COORDINATOR_COMMANDS, SERVICE, passes_to=TO_SERVICES
    )
    tls_ca: str | None = flag(
        None,
        "--tls-ca",
        "PEM CA certificate(s) of the mTLS between the coordinator and its workers: the coordinator dials its "
        "workers over TLS, checking their certificates with it and presenting its own --tls-cert",
        COORDINATOR_COMMANDS,
        SERVICE,
        helps={"serve": "PEM CA certificate(s) that signed --tls-cert: the services talk mTLS with each other"},
        passes_to=TO_SERVICES,
    )
    tls_server_name: str | None = flag(
        None,
        "--tls-server-name",
        "the name the workers' certificates are checked against, where it is not the host of --target/--draft",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    api_key: str | None = flag(
        None,
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
    )
    api_key_file: str | None = flag(
        None,
        "--api-key-file",
        "file whose first line is the --api-key",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    # Connection limits of each public port, gRPC and HTTP apart (`minedraft.rpc.limits.ConnectionLimits`)
    max_connections: int = flag(
        1024,
        "--max-connections",
        "most connections open at once on each public port (gRPC, HTTP): beyond, a new one is refused at once (HTTP "
        "first shuts the one waiting longest for a request); lowered to fit the open-files limit",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    header_timeout: float = flag(
        10.0,
        "--header-timeout",
        "seconds a new connection has to send its request's headers (HTTP) or finish its TLS and HTTP/2 handshake "
        "(gRPC) before it is closed",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    idle_timeout: float = flag(
        60.0,
        "--idle-timeout",
        "seconds a connection may stay open without a call (gRPC) or between requests (HTTP keep-alive) before it "
        "is closed",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    lease_secret: str | None = flag(  # (also the workers': `minedraft.rpc.options`)
        None,
        "--lease-secret",
        LEASE_SECRET_HELP,
        COORDINATOR_COMMANDS,
        SERVICE,
        helps={
            "serve": "the services' --lease-secret, through MINEDRAFT_LEASE_SECRET in their environment; serve makes a "
            "random one when none is given",
        },
    )

    @property
    def limits(self) -> Limits:
        from coordinator.validation import Limits  # (torch, through sampling: not for the CLI's flags)

        return Limits(self.max_prompt_bytes, self.max_messages, self.max_stop_strings, self.max_stop_string_bytes)


@dataclass(kw_only=True)
class CoordinatorOptions(PublicPortOptions):
    """Each field with a flag is set by it (`minedraft_app.flags`); the field's default is the flag's."""

    target: str = field(
        metadata={FLAG_KEY: Flag("--target", "target service address", _ONLY_COORDINATOR, SERVICE, required=True)}
    )
    draft: str | None = field(
        metadata={
            FLAG_KEY: Flag("--draft", "draft service address (not needed in ar mode)", _ONLY_COORDINATOR, SERVICE)
        }
    )
    mode: str = flag(
        "psd",
        "--mode",
        "psd: draft one batch while the other is verified; sd: draft, then verify; ar: the target alone",
        COORDINATOR_COMMANDS,
        SPECULATION,
        choices=("psd", "sd", "ar"),
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    num_speculative_tokens: int = flag(
        4,
        "--num-speculative-tokens",
        "tokens the draft proposes per step (k)",
        POLICY_COMMANDS,
        SPECULATION,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    # serve's and bench's, which they pass on to the workers too (WorkerOptions has the workers' own)
    max_batch_size: int = flag(
        32,
        "--max-batch-size",
        "sequences per batch (psd runs two batches, so a worker holds twice as many)",
        POLICY_COMMANDS,
        BATCHES,
        defaults={"bench": 8},
        passes_to=TO_SERVICES,
        helm=_ONLY_COORDINATOR,
    )
    max_queue_size: int = flag(
        256,
        "--max-queue-size",
        "requests that may wait for a batch; more are refused until some start",
        COORDINATOR_COMMANDS,
        BATCHES,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    max_prefill_tokens: int = flag(  # `BatchManager`
        8192,
        "--max-prefill-tokens",
        "prompt tokens one step prefills at most (0: no limit; a longer prompt goes alone), so that a burst of "
        "requests is admitted over several steps",
        POLICY_COMMANDS,
        BATCHES,
        defaults={"bench": None},
        helps={"bench": "the coordinators' --max-prefill-tokens (default: theirs)"},
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    channel: str = flag(
        "auto",
        "--channel",
        "how drafts reach the target: auto picks cuda-ipc between GPUs of one host, nccl between other GPUs and "
        "grpc otherwise (serve --single-process: local)",
        POLICY_COMMANDS,
        SPECULATION,
        choices=("auto", "local", "grpc", "cuda-ipc", "nccl"),
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    channel_setup_timeout: float = flag(
        60.0,
        "--channel-setup-timeout",
        "seconds the channel's set-up between target and draft may take (an nccl rendezvous, at start-up and for a "
        "worker back after a loss) before it fails naming the channel and both workers; its calls get 10 s more",
        POLICY_COMMANDS,
        SPECULATION,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    tokenizer: str | None = flag(
        None,
        "--tokenizer",
        "tokenizer directory for text prompts (default: the target's model directory)",
        _ONLY_COORDINATOR,
        SERVICE,
        helm=_ONLY_COORDINATOR,
    )
    served_model_name: list[str] | None = flag(
        None,
        "--served-model-name",
        "the model's names in the HTTP API, one or more (the first is the one /v1/models reports; a request may name "
        "any); default: the target's model directory",
        COORDINATOR_COMMANDS,
        SERVICE,
        nargs="+",
        passes_to=TO_COORDINATOR,
    )
    tool_call_parser: str = flag(
        "hermes",
        "--tool-call-parser",
        "the format the model writes tool calls in, parsed into a chat answer's tool_calls: hermes (<tool_call>{json}"
        "</tool_call>: Hermes, Qwen, SmolLM) or llama3_json (a JSON object with name and parameters: Llama 3)",
        COORDINATOR_COMMANDS,
        SERVICE,
        choices=("hermes", "llama3_json"),
        passes_to=TO_COORDINATOR,
    )
    step_trace: str | None = flag(
        None,
        "--step-trace",
        "on shutdown, write every worker call to this file as JSON lines",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    overlap: str = flag(
        "auto",
        "--overlap",
        "psd: run Verify and Propose concurrently always, never, or where that measures faster (auto; on a GPU "
        "that target and draft share, auto runs sd on one batch of twice --max-batch-size)",
        POLICY_COMMANDS,
        SPECULATION,
        choices=("auto", "always", "never"),
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    speculation: str = flag(
        "auto",
        "--speculation",
        "psd and sd: draft at every step (always), or let the target decode alone while that measures faster per "
        "token than drafting (auto)",
        POLICY_COMMANDS,
        SPECULATION,
        choices=("auto", "always"),
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    min_speculative_tokens: int = flag(
        0,
        "--min-speculative-tokens",
        "with --speculation auto, steps may also draft fewer tokens, halving from --num-speculative-tokens down to "
        "this many, where that measures cheaper per token (0: all of them, or none)",
        POLICY_COMMANDS,
        SPECULATION,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    tetris: bool = flag(
        False,
        "--tetris",
        "psd and sd: the draft proposes --tetris-extra-proposals more tokens a row, and of the batch's drafts only "
        "the --verify-token-budget most likely to be accepted (by the draft's probabilities) are verified, each row "
        "a prefix (docs/design.md section 14)",
        POLICY_COMMANDS,
        SPECULATION,
        switch=True,
        passes_to=TO_COORDINATOR,
    )
    tetris_extra_proposals: str = flag(
        "2",
        "--tetris-extra-proposals",
        "with --tetris: extra drafts a row beyond the step's k, a count, or auto: the most of 0, 2, 4 that keep the "
        "draft's step within the measured verify it hides behind (none where no verify hides it: sd, psd in turn or "
        "as one batch on a shared GPU)",
        POLICY_COMMANDS,
        SPECULATION,
        passes_to=TO_COORDINATOR,
    )
    verify_token_budget: int = flag(
        0,
        "--verify-token-budget",
        "with --tetris: drafts a verify checks over its batch (0: k times the batch's sequences)",
        POLICY_COMMANDS,
        SPECULATION,
        passes_to=TO_COORDINATOR,
    )
    step_calls: str = flag(
        "stream",
        "--step-calls",
        "how Verify and Propose travel: as messages on one open stream per worker (stream: ~0.5 ms less a call on "
        "an H200 host), or as unary calls, which a worker without the streams gets either way",
        COORDINATOR_COMMANDS,
        SPECULATION,
        choices=("stream", "unary"),
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    draft_retry_interval: float = flag(
        5.0,
        "--draft-retry-interval",
        "seconds between tries to reach a lost draft service (requests go on with the target alone) or a lost "
        "target service (requests are refused meanwhile)",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    draft_timeout: float = flag(
        30.0,
        "--draft-timeout",
        "seconds a draft call may take before the draft service counts as lost (a hung draft); a proposal's own "
        "deadline is 20x the median proposal time (at least 1 s) when that is shorter",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    target_timeout: float = flag(
        120.0,
        "--target-timeout",
        "seconds a target prefill, verify or release may take before the target service counts as lost and its "
        "requests end with UNAVAILABLE until it answers again (0: no limit); a verify's own deadline is 20x the "
        "median verify time (at least 10 s) when that is shorter",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    worker_keepalive: float = flag(
        5.0,
        "--worker-keepalive",
        "seconds between the coordinator's keepalive pings to each worker (at least 1): a worker that answers none "
        "for as long again (stopped, hung, its host gone) is lost, so its requests end UNAVAILABLE and health turns "
        "NOT_SERVING within twice this, whatever call was waiting on it",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
    )
    drain_timeout: float = flag(  # `drain`
        30.0,
        "--drain-timeout",
        "on SIGTERM, seconds the admitted requests get to finish while health reports NOT_SERVING and new requests "
        "get UNAVAILABLE; SIGINT (Ctrl-C) stops at once",
        COORDINATOR_COMMANDS,
        SERVICE,
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
    # `coordinator.http_api`. The command line serves it on 8000; a coordinator made in code (tests, tools) opens no
    # second port unless asked.
    http_port: int = flag(
        0,
        "--http-port",
        "port of the OpenAI-compatible HTTP API beside the gRPC one (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health), on --host (0: off)",
        ("serve", "coordinator", "bench"),
        SERVICE,
        defaults={"serve": 8000, "coordinator": 8000},
        helps={"bench": "the OpenAI-compatible HTTP port of the coordinators it starts (0: off)"},
        passes_to=TO_COORDINATOR,
        helm=_ONLY_COORDINATOR,
    )
