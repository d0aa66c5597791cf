"""The coordinator put together: its parts built in one place, started and stopped in order, and served."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING

import grpc

from coordinator.batch_manager import BatchManager
from coordinator.failover import GENERATION_SERVICE
from coordinator.front_door import FrontDoor
from coordinator.grpc_api import GenerationServicer
from coordinator.options import CoordinatorOptions
from coordinator.pairing import Layout, shared_gpus
from coordinator.step_loop import StepLoop
from coordinator.stream_outbox import StreamOutbox
from coordinator.tracing import tracing_for
from coordinator.workers import Workers
from minedraft.engine.models import load_tokenizer
from minedraft.errors import ModelLoadError
from minedraft.observability.metrics import CoordinatorMetrics
from minedraft.observability.telemetry import Tracing
from minedraft.proto import generation_pb2_grpc
from minedraft.rpc.lease import deployment_secret
from minedraft.rpc.limits import ConnectionLimits, fitted
from minedraft.rpc.security import coordinator_worker_tls, read_api_key, server_credentials
from minedraft.rpc.server_utils import Health, start_server

if TYPE_CHECKING:
    from coordinator.http_api import HttpServer

log = logging.getLogger(__name__)


class Coordinator:
    """The workers, the batch manager, the step loop and the front door, wired once; `start` brings them up in the
    order the pair needs, `drain` and `stop` take them down (with the HTTP API, where `serve` started one)."""

    def __init__(
        self, options: CoordinatorOptions, tracing: Tracing | None = None, metrics: CoordinatorMetrics | None = None
    ) -> None:
        self.options = options
        self.front_door: FrontDoor  # made last: it fronts the parts below
        tracer = tracing.tracer if tracing is not None else None
        self.health = Health()  # follows the target's (`Failover`); NOT_SERVING from the start of a drain
        wake = asyncio.Event()  # the step loop's: new work, a stop, or news from the workers
        outbox = StreamOutbox()  # what a step emits, until the next worker calls are sent
        self.workers = Workers(
            options.target,
            options.draft if options.mode != "ar" else None,
            tracing=tracing_for(tracer),  # decided once: off, no span object is ever made
            step_streams=options.step_calls == "stream",
            channel=options.channel,
            channel_setup_timeout=options.channel_setup_timeout,
            draft_timeout=options.draft_timeout,
            target_timeout=options.target_timeout or None,
            retry_interval=options.draft_retry_interval,
            keepalive=options.worker_keepalive,
            metrics=metrics,
            record_events=options.step_trace is not None,
            call_started=outbox.call_started,
            health=self.health,
            wake=wake,
            open_requests=lambda: self.front_door.open_streams,
            tls=coordinator_worker_tls(options.tls_ca, options.tls_cert, options.tls_key, options.tls_server_name),
        )
        secret = deployment_secret(options.lease_secret)  # workers started with one want it (else: this process's)
        if secret is not None:
            for ticket in self.workers.pair.tickets.values():
                ticket.secret = secret
        num_batches = 2 if options.mode == "psd" else 1
        self.manager = BatchManager(
            options.max_batch_size, options.max_queue_size, num_batches, options.max_prefill_tokens
        )
        self.loop = StepLoop(
            self.workers,
            self.manager,
            options.mode,
            options.num_speculative_tokens,
            outbox=outbox,
            wake=wake,
            metrics=metrics,
            overlap=options.overlap,
            speculation=options.speculation,
            min_k=options.min_speculative_tokens,
            tetris=options.tetris,
            extra_proposals=options.tetris_extra_proposals,
            verify_token_budget=options.verify_token_budget,
        )
        self.front_door = FrontDoor(options, self.workers, self.manager, self.loop, self.health, tracer, metrics)
        if metrics is not None:
            metrics.track_state(
                lambda: self.manager.queue_length,
                lambda: self.manager.num_running,
                lambda: float(self.workers.failover.draft_connected),
                lambda: len(self.manager.batches),
                lambda: float(self.loop.drafting),
                lambda: float(self.loop.draft_length),
            )
            metrics.add_vllm_names(lambda: self.front_door.model, self._target_kv_usage)
        self.http: HttpServer | None = None  # the HTTP API, when `serve` started it
        self._task: asyncio.Task[None] | None = None

    def _target_kv_usage(self) -> float:
        """The fraction of the target's KV blocks that sequences hold, as its last reply reported (0 before one)."""
        ledger = self.workers.target.ledger
        return 1 - ledger.reported / ledger.num_blocks if ledger.accounted and ledger.num_blocks else 0.0

    async def start(self) -> None:
        """Check the pair, lay the batches out, set up the channel through both workers' control RPCs, start the
        step loop, and follow the workers' health."""
        pair = self.workers.pair
        await pair.connect()
        self.workers.failover.liveness.keep_leases()
        if self.workers.has_draft:
            self._lay_out_batches()
        await pair.set_up(
            Layout(
                self.manager.max_batch_size,
                len(self.manager.batches),
                max(self.loop.prepared_lengths, default=self.options.num_speculative_tokens),
                self.loop.prepared_lengths,
                tetris=self.loop.tetris,
            )
        )
        self.workers.failover.reset_ledgers()
        tokenizer_dir = self.options.tokenizer or pair.target_info.model
        try:
            # In a thread: this start's synchronous work after SetUp (this load, with transformers' import) took
            # seconds on a GPU host, long enough for the workers' leases, which this loop renews.
            self.front_door.tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_dir)
        except ModelLoadError:
            log.warning("no tokenizer at %s: only token-id prompts are served", tokenizer_dir)
        self._task = asyncio.create_task(self.loop.run())
        self.workers.failover.liveness.watch_health()

    def _lay_out_batches(self) -> None:
        """psd with `--overlap auto` on a GPU that target and draft share: one batch of both batches' room, drafted and
        verified one after the other (sd). There a verify of 2B rows costs little more than one of B, and the two
        processes' kernels hardly overlap: on one H200 (8B and 1B shapes, compiled, B=32) one batch of 64 served
        1.14x the tokens of two alternating batches of 32 time-sliced, 1.04x under MPS, at a lower TPOT.
        `--overlap always` keeps the two batches."""
        if self.options.mode != "psd" or self.options.overlap != "auto":
            return
        shared = shared_gpus(self.workers.pair.target_info, self.workers.pair.draft_info)
        if shared:
            self.manager.merge_batches()
            self.loop.mode = "sd"
            log.info(
                "target and draft share GPU %s: one batch of up to %d sequences, drafted and verified in turn "
                "(overlapping two batches does not pay on one GPU; --overlap always keeps them)",
                ", ".join(shared),
                self.manager.max_batch_size,
            )

    async def drain(self, cut_short: asyncio.Event) -> None:
        """Stop taking requests and let the admitted ones finish, for up to `drain_timeout` seconds or until
        `cut_short` is set (a SIGTERM's graceful shutdown, before `stop`): health reports NOT_SERVING, so a load
        balancer or Kubernetes sends new requests elsewhere, and a new request gets UNAVAILABLE."""
        await self.workers.failover.drain()
        front, timeout = self.front_door, self.options.drain_timeout
        log.info("draining: %d requests to finish, for up to %.0f s", front.open_streams, timeout)
        deadline = time.monotonic() + timeout
        while front.open_streams and time.monotonic() < deadline and not cut_short.is_set():
            await asyncio.sleep(0.05)
        if front.open_streams:
            log.warning("drain ended with %d requests unfinished: their clients get UNAVAILABLE", front.open_streams)

    async def stop(self) -> None:
        """Refuse new requests, stop the step loop, end every open stream (UNAVAILABLE), close the HTTP API and
        give the workers up."""
        self.front_door.refuse_new()
        if self.http is not None:
            self.http.begin_stop()  # no new connections; open streams end with the step loop's shutdown below
        self.workers.failover.stop()
        self.loop.stop()
        if self._task is not None:
            await self._task
        await self.loop.shutdown()
        if self.http is not None:
            await self.http.stopped()
        if self.options.step_trace:
            with open(self.options.step_trace, "w") as f:  # the worker calls as JSON lines (a timeline plot)
                f.write("\n".join(json.dumps(vars(e)) for e in self.workers.events))
        await self.workers.close()


async def serve(
    options: CoordinatorOptions,
    port: int,
    host: str = "[::]",
    tracing: Tracing | None = None,
    metrics: CoordinatorMetrics | None = None,
) -> tuple[grpc.aio.Server, int, Coordinator]:
    """The coordinator started, its gRPC server on `port` and, with `options.http_port`, the OpenAI-compatible HTTP
    API beside it in this event loop (`Coordinator.stop` stops it); both serve TLS only with `options.tls_cert`, and
    want the bearer token with an API key."""
    # Checked before the workers are dialled: a wrong file fails the start-up at once, with its flag named.
    credentials = server_credentials(options.tls_cert, options.tls_key)
    api_key = read_api_key(options.api_key, options.api_key_file)
    limits = ConnectionLimits(options.max_connections, options.header_timeout, options.idle_timeout)
    limits.check()
    limits = fitted(limits, 2 if options.http_port else 1)  # each port its own descriptors: neither starves the other
    http_socket = None
    if options.http_port:
        # Bound before anything starts: a port in use fails the start-up at once, naming it. (FastAPI is imported
        # only here: not on every machine.)
        from coordinator.http_api import bind_http

        http_socket = bind_http(host, options.http_port)
    coordinator = Coordinator(options, tracing, metrics)
    try:
        await coordinator.start()
    except BaseException:
        if http_socket is not None:
            http_socket.close()
        raise
    servicer = GenerationServicer(coordinator.front_door)
    server, bound = await start_server(
        port,
        [lambda s: generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, s)],
        [GENERATION_SERVICE],
        host,
        health_servicer=coordinator.health,
        max_receive_bytes=options.max_request_bytes,
        credentials=credentials,
        api_key=api_key,
        limits=limits,
    )
    if http_socket is not None:
        from coordinator.http_api import start_http_server

        coordinator.http = start_http_server(coordinator.front_door, http_socket, api_key, limits, metrics)
    return server, bound, coordinator
