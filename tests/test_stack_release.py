"""Releases ride on the next call to each worker: a step that finishes a request waits for no Release."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import pytest
from stack import TinyPairs, Workers, assert_all_slots_free, running_coordinator, text_prompts

from minedraft.proto import generation_pb2, generation_pb2_grpc
from minedraft.rpc.lease import LEASE_METADATA

pytest_plugins = ["stack"]

RELEASE_DELAY = 2.0  # seconds a proxy holds each Release


@dataclass(frozen=True)
class Address:
    address: str


class DelayingProxy(grpc.GenericRpcHandler):
    """Forwards every call to `upstream` as bytes (the step streams as streams) with the lease it presents, secret
    and all, holding Release calls for RELEASE_DELAY first."""

    def __init__(self, upstream: str) -> None:
        self.channel = grpc.insecure_channel(upstream)

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = details.method
        if method.endswith("Stream"):
            forward_stream: grpc.StreamStreamMultiCallable[bytes, bytes] = self.channel.stream_stream(method)
            return grpc.stream_stream_rpc_method_handler(
                lambda requests, context: forward_stream(requests, metadata=_lease(context))
            )
        forward: grpc.UnaryUnaryMultiCallable[bytes, bytes] = self.channel.unary_unary(method)  # bytes through

        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            if method.endswith("/Release"):
                time.sleep(RELEASE_DELAY)
            return forward(request, timeout=60, metadata=_lease(context))

        return grpc.unary_unary_rpc_method_handler(handle)


def _lease(context: grpc.ServicerContext) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((key, value) for key, value in context.invocation_metadata() if key.startswith(LEASE_METADATA))


@pytest.fixture
def slow_releases(llama_workers: Workers) -> Iterator[Workers]:
    """The tiny Llama workers, each reached through a proxy that delays every Release by RELEASE_DELAY."""
    assert llama_workers.draft is not None
    proxies, servers, addresses = [], [], []
    for worker in (llama_workers.target, llama_workers.draft):
        proxies.append(DelayingProxy(worker.address))
        servers.append(grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[proxies[-1]]))
        addresses.append(Address(f"127.0.0.1:{servers[-1].add_insecure_port('127.0.0.1:0')}"))
        servers[-1].start()
    try:
        yield replace(llama_workers, target=addresses[0], draft=addresses[1])  # type: ignore[arg-type]
    finally:
        for server, proxy in zip(servers, proxies, strict=True):
            server.stop(grace=None)
            proxy.channel.close()


async def _arrivals(address: str, request: generation_pb2.GenerateRequest) -> list[float]:
    """When each streamed message of one Generate call arrived (time.monotonic())."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = generation_pb2_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
        return [time.monotonic() async for _ in call]


def test_a_finishing_step_waits_for_no_release(
    slow_releases: Workers, llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path
) -> None:
    short, long = text_prompts(tiny_pairs.tokenizer, 2, 8, 16, seed=5)

    def request(prompt: list[int], max_tokens: int) -> generation_pb2.GenerateRequest:
        params = generation_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)

    async def both(address: str) -> tuple[list[float], list[float]]:
        first, second = await asyncio.gather(
            _arrivals(address, request(short, 3)), _arrivals(address, request(long, 48))
        )
        return first, second

    with running_coordinator(slow_releases, stack_logs, "psd", extra=["--overlap", "always"]) as coordinator:
        short_times, long_times = asyncio.run(both(coordinator.address))
    # The short request ended first and the long one went on streaming, without waiting for the short one's release.
    assert short_times[-1] < long_times[-2]
    gaps = sorted(b - a for a, b in zip(long_times, long_times[1:]))
    assert gaps[-1] < RELEASE_DELAY / 2, f"a step waited for a release: gaps {gaps[-3:]}"
    assert_all_slots_free(llama_workers)
