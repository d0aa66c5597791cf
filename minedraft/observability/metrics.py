"""Prometheus metrics of the coordinator and the two workers, each in its own registry, served over HTTP."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

from minedraft.proto import generation_pb2

log = logging.getLogger(__name__)

SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EFFICIENCY = (0.25, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 1.0)
ACCEPTED_LENGTH = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0)
RATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
VERIFIED_DRAFTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16)


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> int:
    """Serve `registry` at http://host:port/metrics in a daemon thread (port 0 here means: do not serve)."""
    if not port:
        return 0
    address = host.strip("[]") or "0.0.0.0"
    try:
        server, _ = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        where = f"{host} port {port} (--metrics-port; 0 turns it off)"
        raise OSError(f"the /metrics port cannot listen on {where}: {exc}") from exc
    bound = int(server.server_address[1])
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return bound


def finish_reason_name(reason: int) -> str:
    return generation_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def mean_accepted_length(accepted_tokens: int, drafted_steps: int, steps: int) -> float:
    """Tokens a drafted verify step emitted (accepted drafts + the target's own), as vLLM counts it; 1 when no step
    drafted, 0 before any step. Over drafted steps only: under `--speculation auto` the target's steps alone would
    dilute it towards 1 where it describes the draft."""
    return accepted_tokens / drafted_steps + 1 if drafted_steps else float(steps > 0)


class CoordinatorMetrics:
    """Requests, tokens, acceptance, step times, overlap, batch sizes, queue, TTFT and TPOT, in the coordinator.

    Token and acceptance counters grow at every step (what `rate()` needs) by exactly what each request's Usage
    adds up, so over finished requests they equal the sums of the usage the clients got.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("minedraft_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("minedraft_requests_rejected", "Requests refused at admission", ["reason"], registry=r)
        self.preemptions = Counter(
            "minedraft_preemptions", "Running sequences preempted for KV blocks, to be prefilled again", registry=r
        )
        self.prompt_tokens = Counter("minedraft_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("minedraft_generation_tokens", "Tokens generated and streamed", registry=r)
        self.draft_tokens = Counter("minedraft_draft_tokens", "Draft tokens proposed and verified", registry=r)
        self.accepted_tokens = Counter("minedraft_accepted_tokens", "Draft tokens the target accepted", registry=r)
        self.accepted_by_position = Counter(
            "minedraft_accepted_tokens_by_position",
            "Draft tokens accepted at each draft position (0 = first); divide by minedraft_verified_sequences",
            ["position"],
            registry=r,
        )
        self.verified_sequences = Counter(
            "minedraft_verified_sequences", "Sequences verified with drafts, summed over steps", registry=r
        )
        self.verify_steps = Counter("minedraft_verify_steps", "Verify calls with drafts", registry=r)
        # TETRIS (design section 14)
        self.tetris_verified_drafts = Histogram(
            "minedraft_tetris_verified_drafts",
            "Drafts a row verified of its proposal, as the TETRIS selection kept them",
            buckets=VERIFIED_DRAFTS,
            registry=r,
        )
        self.tetris_extra_drafts = Counter(
            "minedraft_tetris_extra_drafts", "Drafts proposed past the step's k (TETRIS's extra proposals)", registry=r
        )
        self.tetris_extra_accepted = Counter(
            "minedraft_tetris_extra_accepted",
            "Drafts accepted past the step's k (from the extra proposals)",
            registry=r,
        )
        self.tetris_budget_use = Histogram(
            "minedraft_tetris_budget_use",
            "Drafts a TETRIS verify checked over its --verify-token-budget",
            buckets=RATES,
            registry=r,
        )
        self.step_seconds = Histogram(
            "minedraft_step_seconds", "Worker call time seen by the coordinator", ["kind"], buckets=SECONDS, registry=r
        )
        self.batch_size = Histogram(
            "minedraft_batch_size", "Sequences per worker call", ["kind"], buckets=BATCH_SIZES, registry=r
        )
        self.overlapped_step_seconds = Histogram(
            "minedraft_overlapped_step_seconds",
            "Time of a PSD step (verify of one batch, propose of the other)",
            buckets=SECONDS,
            registry=r,
        )
        self.overlap_efficiency = Histogram(
            "minedraft_overlap_efficiency",
            "max(T_draft, T_verify) / T_step of each PSD step",
            buckets=EFFICIENCY,
            registry=r,
        )
        self.queue_length = Gauge("minedraft_queue_length", "Requests waiting for admission", registry=r)
        self.running = Gauge("minedraft_running_sequences", "Sequences in the batches", registry=r)
        self.batches = Gauge(
            "minedraft_batches",
            "Batches the coordinator alternates: 2 in psd, 1 in sd (and in psd on a GPU that target and draft share)",
            registry=r,
        )
        self.draft_connected = Gauge(
            "minedraft_draft_connected",
            "1 while a draft service is connected; 0 in ar mode or while a lost draft service is retried",
            registry=r,
        )
        self.drafting = Gauge(
            "minedraft_drafting",
            "1 while steps draft; 0 while the target decodes alone (ar mode, "
            "a lost draft, or drafts measured not to pay: --speculation auto)",
            registry=r,
        )
        self.draft_length = Gauge(
            "minedraft_draft_length",
            "Tokens a step drafts at the current batch size (the speculation policy's length: "
            "--min-speculative-tokens); 0 while the target decodes alone",
            registry=r,
        )
        self.ttft = Histogram(
            "minedraft_time_to_first_token_seconds", "Time to first token per request", buckets=LATENCY, registry=r
        )
        self.tpot = Histogram(
            "minedraft_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=SECONDS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "minedraft_request_duration_seconds", "Arrival to end, per request", buckets=LATENCY, registry=r
        )
        self.mean_accepted_length = Histogram(
            "minedraft_request_mean_accepted_length",
            "Per request: accepted drafts per drafted verify step, plus one (the tokens such a step emitted)",
            buckets=ACCEPTED_LENGTH,
            registry=r,
        )
        self.acceptance_rate = Histogram(
            "minedraft_request_acceptance_rate",
            "Per request: accepted / proposed draft tokens",
            buckets=RATES,
            registry=r,
        )
        self._step_kinds = {
            kind: (self.step_seconds.labels(kind), self.batch_size.labels(kind))
            for kind in ("prefill", "propose", "verify")
        }
        self._positions: list[Any] = []
        self._last_call: dict[str, tuple[float, float]] = {}

    def track_state(
        self,
        queue_length: Callable[[], float],
        running: Callable[[], float],
        draft_connected: Callable[[], float],
        batches: Callable[[], float],
        drafting: Callable[[], float],
        draft_length: Callable[[], float],
    ) -> None:
        """Gauges read at scrape time (nothing on the hot path)."""
        self.draft_length.set_function(draft_length)
        self.queue_length.set_function(queue_length)
        self.running.set_function(running)
        self.draft_connected.set_function(draft_connected)
        self.drafting.set_function(drafting)
        self.batches.set_function(batches)

    def add_vllm_names(self, model_name: Callable[[], str], kv_cache_usage: Callable[[], float]) -> None:
        """Also serve the figures vLLM's dashboards, the production stack's router and KEDA read, under vLLM's names
        (`VllmNames`): `model_name` is the served model's, `kv_cache_usage` the target's (0 to 1), read at scrape
        time."""
        self.registry.register(VllmNames(self, model_name, kv_cache_usage))

    def worker_call(self, kind: str, size: int, start: float, end: float) -> None:
        """One prefill, propose or verify call, timed by the coordinator (perf_counter seconds)."""
        children = self._step_kinds.get(kind)
        if children is None:
            children = self._step_kinds[kind] = (self.step_seconds.labels(kind), self.batch_size.labels(kind))
        seconds, sizes = children
        seconds.observe(end - start)
        sizes.observe(size)
        self._last_call[kind] = (start, end)

    def overlapped_step(self, start: float, end: float) -> None:
        """A PSD step (verify of one batch, propose of the other) took [start, end]: observe its overlap efficiency."""
        verify, propose = self._last_call.get("verify"), self._last_call.get("propose")
        if verify is None or propose is None or min(verify[0], propose[0]) < start or end <= start:
            return  # a call failed: no timing for this step
        t_step = end - start
        self.overlapped_step_seconds.observe(t_step)
        self.overlap_efficiency.observe(max(verify[1] - verify[0], propose[1] - propose[0]) / t_step)

    def prefilled(self, prompt_tokens: int, results: Sequence[Any]) -> None:
        """A prefill of `prompt_tokens` new prompt tokens (a preempted request's again not counted) answered."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(sum(len(r.token_ids) for r in results))

    def verified(self, results: Sequence[Any], k: int, selected: bool = False) -> None:
        """The results of one verify of k drafts per sequence (the same figures RequestState.record_verify adds;
        `selected`: TETRIS's, each row's verified drafts counted)."""
        self.generation_tokens.inc(sum(len(r.token_ids) for r in results))
        if not k:
            return
        counts = [0] * (k + 1)  # counts[a]: sequences that accepted a drafts and emitted them
        for result in results:
            counts[min(result.num_accepted, len(result.token_ids), k)] += 1
        self.verify_steps.inc()
        self.verified_sequences.inc(len(results))
        self.draft_tokens.inc(sum(r.num_verified_drafts for r in results) if selected else k * len(results))
        self.accepted_tokens.inc(sum(a * n for a, n in enumerate(counts)))
        while len(self._positions) < k:
            self._positions.append(self.accepted_by_position.labels(str(len(self._positions))))
        at_least = 0  # sequences that accepted position i: those with more than i accepted
        for i in range(k, 0, -1):
            at_least += counts[i]
            if at_least:
                self._positions[i - 1].inc(at_least)

    def tetris_verified(self, results: Sequence[Any], drafted: int, policy_k: int, budget: int) -> None:
        """A verify of TETRIS-selected drafts: `drafted` proposed a row, `policy_k` of them the step's k, `budget`
        the drafts it could verify; each result tells its row's verified drafts (num_verified_drafts)."""
        verified = 0
        for result in results:
            self.tetris_verified_drafts.observe(result.num_verified_drafts)
            verified += result.num_verified_drafts
        self.tetris_extra_drafts.inc((drafted - policy_k) * len(results))
        self.tetris_extra_accepted.inc(sum(max(0, r.num_accepted - policy_k) for r in results))
        if budget:
            self.tetris_budget_use.observe(verified / budget)

    def request_finished(self, finish_reason: str, usage: generation_pb2.Usage | None, seconds: float) -> None:
        """A request ended ("stop", "length", "cancelled", "error"); `usage` is what its client got, if anything."""
        self.requests.labels(finish_reason).inc()
        self.request_seconds.observe(seconds)
        if usage is None:
            return
        if usage.completion_tokens:
            self.ttft.observe(usage.time_to_first_token_s)
        if usage.completion_tokens > 1:
            self.tpot.observe(usage.time_per_output_token_s)
        if usage.draft_tokens:
            self.mean_accepted_length.observe(usage.mean_accepted_length)
            self.acceptance_rate.observe(usage.acceptance_rate)

    def request_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()


# vLLM's name -> (the coordinator's metric it is read from (an attribute of CoordinatorMetrics), its help). Each is
# read at scrape time from the one metric that counts it: no second counter on the step loop's path.
VLLM_NAMES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("running", "Sequences in the batches"),
    "vllm:num_requests_waiting": ("queue_length", "Requests waiting for admission"),
    "vllm:prompt_tokens": ("prompt_tokens", "Prompt tokens admitted"),
    "vllm:generation_tokens": ("generation_tokens", "Tokens generated"),
    "vllm:time_to_first_token_seconds": ("ttft", "Time to first token per request"),
    "vllm:time_per_output_token_seconds": ("tpot", "Mean time per output token after the first, per request"),
    "vllm:inter_token_latency_seconds": ("tpot", "Mean time per output token after the first, per request"),
    "vllm:e2e_request_latency_seconds": ("request_seconds", "Arrival to end, per request"),
    "vllm:spec_decode_num_drafts": ("verified_sequences", "Drafts verified (a sequence's drafts of one step)"),
    "vllm:spec_decode_num_draft_tokens": ("draft_tokens", "Draft tokens verified"),
    "vllm:spec_decode_num_accepted_tokens": ("accepted_tokens", "Draft tokens accepted"),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("accepted_by_position", "Draft tokens accepted by position"),
}
# vLLM's finished_reason of a successful request, by the coordinator's finish reason
SUCCESS_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class VllmNames:
    """A collector that serves the coordinator's figures under vLLM's names and labels (model_name, engine), as
    `docs/observability.md` lists them, and the target's KV cache usage as vllm:kv_cache_usage_perc."""

    def __init__(
        self, metrics: CoordinatorMetrics, model_name: Callable[[], str], kv_cache_usage: Callable[[], float]
    ) -> None:
        self.metrics, self.model_name, self.kv_cache_usage = metrics, model_name, kv_cache_usage

    def describe(self) -> list[Metric]:
        return []  # (names checked at collect: the model's name is known only once the target answered)

    def collect(self) -> Iterator[Metric]:
        labels = {"model_name": self.model_name(), "engine": "0"}
        for name, (source, help_text) in VLLM_NAMES.items():
            for family in getattr(self.metrics, source).collect():
                renamed = Metric(name, help_text, family.type)
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    suffix = sample.name[len(family.name) :]
                    renamed.add_sample(name + suffix, labels | sample.labels, sample.value)
                yield renamed
        kv = Metric("vllm:kv_cache_usage_perc", "The target's KV cache usage (1 = 100%)", "gauge")
        kv.add_sample("vllm:kv_cache_usage_perc", labels, self.kv_cache_usage())
        yield kv
        success = Metric("vllm:request_success", "Requests finished, by finished_reason", "counter")
        for family in self.metrics.requests.collect():
            for sample in family.samples:
                reason = SUCCESS_REASONS.get(sample.labels.get("finish_reason", ""))
                if sample.name.endswith("_total") and reason is not None:
                    value = labels | {"finished_reason": reason}
                    success.add_sample("vllm:request_success_total", value, sample.value)
        yield success


class WorkerMetrics:
    """Per RPC of a target or draft worker: count, time, compute, queue and channel time, batch size; the target counts
    the drafts it verifies and accepts, the draft the drafts it proposes. Fed by telemetry.ServerObserver."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.rpcs = Counter(
            "minedraft_worker_rpcs", "RPCs handled, by method and status", ["method", "code"], registry=r
        )
        self.rpc_seconds = Histogram(
            "minedraft_worker_rpc_seconds",
            "Handler time, waiting for the model included",
            ["method"],
            buckets=SECONDS,
            registry=r,
        )
        self.compute_seconds = Histogram(
            "minedraft_worker_compute_seconds", "Model time per call (Timings)", ["method"], buckets=SECONDS, registry=r
        )
        self.channel_seconds = Histogram(
            "minedraft_worker_channel_seconds",
            "Draft transfer time per call (Timings)",
            ["method"],
            buckets=SECONDS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "minedraft_worker_queue_seconds",
            "Time a call waited for the compute thread (Timings)",
            ["method"],
            buckets=SECONDS,
            registry=r,
        )
        self.batch_size = Histogram(
            "minedraft_worker_batch_size", "Sequences per call", ["method"], buckets=BATCH_SIZES, registry=r
        )
        self.free_slots = Gauge("minedraft_worker_free_slots", "Sequence rows free", registry=r)
        self.kv_blocks = Gauge("minedraft_worker_kv_blocks", "KV cache blocks sequences can hold", registry=r)
        self.kv_blocks_used = Gauge("minedraft_worker_kv_blocks_used", "KV cache blocks sequences hold", registry=r)
        self.kv_blocks_cached = Gauge(
            "minedraft_worker_kv_blocks_cached", "KV cache blocks in the prefix cache, held or not", registry=r
        )
        self.kv_cache_usage = Gauge(
            "minedraft_worker_kv_cache_usage_ratio", "Fraction of the KV cache blocks sequences hold", registry=r
        )
        self.prefix_queried = Gauge(
            "minedraft_worker_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Gauge(
            "minedraft_worker_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", registry=r
        )
        self.tokens = Counter("minedraft_worker_tokens", "Tokens emitted (target: prefill and verify)", registry=r)
        self.draft_tokens = Counter(
            "minedraft_worker_draft_tokens", "Draft tokens proposed (draft) or verified (target)", registry=r
        )
        self.accepted_tokens = Counter("minedraft_worker_accepted_tokens", "Draft tokens accepted (target)", registry=r)

    def observe_call(self, method: str, request: Any, response: Any, seconds: float, code: grpc.StatusCode) -> None:
        self.rpcs.labels(method, code.name).inc()
        self.rpc_seconds.labels(method).observe(seconds)
        if response is None:
            return
        fields = request.DESCRIPTOR.fields_by_name
        size = len(request.seq_ids) if "seq_ids" in fields else len(request.sequences) if "sequences" in fields else 0
        if size and method != "Release":
            self.batch_size.labels(method).observe(size)
        if "timings" in response.DESCRIPTOR.fields_by_name:
            self.compute_seconds.labels(method).observe(response.timings.compute_s)
            self.queue_seconds.labels(method).observe(response.timings.queue_s)
            if method in ("Propose", "Verify"):
                self.channel_seconds.labels(method).observe(response.timings.channel_s)
        if "results" in response.DESCRIPTOR.fields_by_name:
            self.tokens.inc(sum(len(r.token_ids) for r in response.results))
        if method == "Verify" and request.num_draft_tokens:
            self.draft_tokens.inc(request.num_draft_tokens * size)
            # Accepted drafts cut off by EOS or max_tokens were never emitted: Usage leaves them out too.
            self.accepted_tokens.inc(sum(min(r.num_accepted, len(r.token_ids)) for r in response.results))
        elif method == "Propose":
            self.draft_tokens.inc(request.num_draft_tokens * size)
