"""The coordinator's options: what `minedraft coordinator` and `serve` configure it with."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.validation import Limits


@dataclass
class CoordinatorOptions:
    target: str
    draft: str | None
    mode: str = "psd"
    num_speculative_tokens: int = 4
    max_batch_size: int = 32
    max_queue_size: int = 256
    max_prefill_tokens: int = 8192  # prompt tokens per step's prefill (0: no limit), `BatchManager`
    channel: str = "auto"
    tokenizer: str | None = None
    step_trace: str | None = None
    overlap: str = "auto"  # psd: run Verify and Propose concurrently always, never, or when it measures faster
    speculation: str = "auto"  # psd, sd: draft always, or let the target decode alone while that measures faster
    min_speculative_tokens: int = 0  # auto: the fewest tokens a step drafts (halving from k; 0: k, or none)
    step_calls: str = "stream"  # Verify and Propose as messages on a stream per worker, or unary calls
    draft_retry_interval: float = 5.0  # seconds between tries to reach a lost draft service again
    draft_timeout: float = 30.0  # a draft call that takes longer counts the draft service as lost
    target_timeout: float = 120.0  # a target step call that takes longer counts the target service as lost (0: never)
    drain_timeout: float = 30.0  # seconds a SIGTERM leaves the admitted requests to finish (`drain`)
    # The OpenAI-compatible HTTP API's port (`coordinator.http_api`; 0: off). The CLI's default is 8000; a
    # coordinator made in code (tests, tools) opens no second port unless asked.
    http_port: int = 0
    # Limits on one request, checked before any work on it (`coordinator.validation.Limits`)
    max_request_bytes: int = 4 << 20  # the public gRPC server's receive limit
    max_prompt_bytes: int = 1 << 20
    max_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    # Security (`minedraft.rpc.security`): TLS of the public port (gRPC and HTTP) from this certificate and key,
    # which are also its client certificate to workers verified with `tls_ca` (mTLS); the bearer token of the
    # public APIs, given or in a file.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None  # the name the workers' certificates carry, where not the host dialled
    api_key: str | None = None
    api_key_file: str | None = None
    # Connection limits of each public port, gRPC and HTTP apart (`minedraft.rpc.limits.ConnectionLimits`)
    max_connections: int = 1024
    header_timeout: float = 10.0
    idle_timeout: float = 60.0
    lease_secret: str | None = None  # the deployment's lease secret, presented to the workers (else a random one)

    @property
    def limits(self) -> Limits:
        return Limits(self.max_prompt_bytes, self.max_messages, self.max_stop_strings, self.max_stop_string_bytes)
