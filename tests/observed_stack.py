"""An observed stack for tests: a loopback OTLP/gRPC trace receiver, three services exporting to it, /metrics.

Test modules load this as a plugin (``pytest_plugins = ["stack", "observed_stack"]``); its session fixture runs the
stack once: target, draft and coordinator processes with OTEL_EXPORTER_OTLP_ENDPOINT and --metrics-port, two
concurrent requests (one carrying a client traceparent), a scrape of every /metrics, then SIGINT to every service
(which flushes its spans) and the spans the receiver got.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from stack import SERVICE_ENV, Service, TinyPairs, server_port, spawn, wait_all

from minedraft.proto import generation_pb2, generation_pb2_grpc

try:  # without opentelemetry-proto (as on the GPU machines) the stack runs untraced and trace tests skip
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    HAVE_OTLP = True
    TraceServiceServicer: type = trace_service_pb2_grpc.TraceServiceServicer
except ImportError:
    HAVE_OTLP = False
    TraceServiceServicer = object

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
SERVICES = ("coordinator", "target", "draft")
K = 3
MAX_BATCH = 4  # per batch; each worker holds two batches


def _value(value: Any) -> Any:
    """An OTLP AnyValue as a Python value."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One span as the receiver got it: ids in hex, attributes as Python values."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    links: list[tuple[str, str]]
    attributes: dict[str, Any]
    status_code: int
    start_ns: int = 0
    end_ns: int = 0


class OtlpReceiver(TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector on a loopback port, keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name")),
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            status_code=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self.spans += received
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.server.stop(grace=None)


@dataclass
class ObservedRun:
    """What one run of the observed stack produced."""

    usages: list[generation_pb2.Usage]
    token_ids: list[list[int]]
    metrics: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]  # service -> (sample, labels) -> value
    spans: list[ReceivedSpan]
    exit_codes: dict[str, int | None]
    traced: bool
    logs: dict[str, str] = field(default_factory=dict)

    def metric(self, service: str, name: str, **labels: str) -> float:
        return self.metrics[service].get((name, tuple(sorted(labels.items()))), 0.0)

    def metric_sum(self, service: str, name: str) -> float:
        return sum(v for (sample, _), v in self.metrics[service].items() if sample == name)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _spawn(name: str, args: list[str], log_dir: Path, env: dict[str, str]) -> tuple[Service, int]:
    metrics_port = server_port()  # a metrics port must be named (0 turns the endpoint off)
    service = spawn(
        f"observed-{name}", [*args, "--host", "127.0.0.1", "--metrics-port", str(metrics_port)], log_dir, env=env
    )
    return service, metrics_port


async def _requests(address: str) -> list[tuple[list[int], generation_pb2.Usage]]:
    """Two concurrent requests (so that both batches run and PSD steps overlap); the first sends a traceparent."""
    params = [
        generation_pb2.SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
        generation_pb2.SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
    ]
    prompts = ["def main(argv):\n    ", "import os\nimport sys\n"]

    async def one(
        channel: grpc.aio.Channel, prompt: str, p: generation_pb2.SamplingParams, metadata: tuple[tuple[str, str], ...]
    ) -> tuple[list[int], generation_pb2.Usage]:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        ids, usage = [], None
        async for message in stub.Generate(
            generation_pb2.GenerateRequest(prompt=prompt, params=p), timeout=120, metadata=metadata
        ):
            ids += message.token_ids
            if message.finish_reason:
                usage = message.usage
        assert usage is not None
        return ids, usage

    async with grpc.aio.insecure_channel(address) as channel:
        return list(
            await asyncio.gather(
                one(channel, prompts[0], params[0], (("traceparent", CLIENT_TRACEPARENT),)),
                one(channel, prompts[1], params[1], ()),
            )
        )


def run_observed_stack(target: Path, draft: Path, log_dir: Path) -> ObservedRun:
    receiver = OtlpReceiver() if HAVE_OTLP else None
    env = {k: v for k, v in SERVICE_ENV.items() if not k.startswith("OTEL_")}
    if receiver is not None:
        env.update(
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
                # Nothing is exported before shutdown (fewer spans than a batch): the SIGINT flush is under test.
                "OTEL_BSP_SCHEDULE_DELAY": "600000",
                "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            }
        )
    common = ["--dtype", "float32", "--max-batch-size", str(MAX_BATCH), "--max-model-len", "256"]
    services: dict[str, Service] = {}
    metrics_ports: dict[str, int] = {}
    try:
        for name, model in (("target", target), ("draft", draft)):
            services[name], metrics_ports[name] = _spawn(name, [name, "--model", str(model), *common], log_dir, env)
        wait_all(list(services.values()))
        services["coordinator"], metrics_ports["coordinator"] = _spawn(
            "coordinator",
            [
                "coordinator",
                "--target",
                services["target"].address,
                "--draft",
                services["draft"].address,
                "--mode",
                "psd",
                "--num-speculative-tokens",
                str(K),
                "--max-batch-size",
                str(MAX_BATCH),
                "--channel",
                "grpc",
                "--tokenizer",
                str(target),
                "--overlap",
                "always",
                "--speculation",
                "always",
            ],
            log_dir,
            env,
        )
        wait_all([services["coordinator"]])
        results = asyncio.run(_requests(services["coordinator"].address))
        # The clients have their last tokens before the coordinator releases the sequences on the workers.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            scrape(metrics_ports[w]).get(("minedraft_worker_free_slots", ())) != 2 * MAX_BATCH
            for w in ("target", "draft")
        ):
            time.sleep(0.1)
        metrics = {name: scrape(port) for name, port in metrics_ports.items()}
    finally:
        exit_codes = {name: services[name].stop() for name in SERVICES if name in services}
        if receiver is not None:
            receiver.stop()
    return ObservedRun(
        usages=[usage for _, usage in results],
        token_ids=[ids for ids, _ in results],
        metrics=metrics,
        spans=receiver.spans if receiver is not None else [],
        exit_codes=exit_codes,
        traced=receiver is not None,
        logs={name: service.log_tail() for name, service in services.items()},
    )


@pytest.fixture(scope="session")
def observed_run(tiny_pairs: TinyPairs, tmp_path_factory: pytest.TempPathFactory) -> ObservedRun:
    """The gpt2 pair (its draft is the target's first layer, so some drafts are accepted) run once per session."""
    pair = tiny_pairs["gpt2"]
    return run_observed_stack(pair.target, pair.draft, tmp_path_factory.mktemp("observed_stack"))
