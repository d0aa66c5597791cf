"""The draft service: gRPC front of the proposer; drafts leave through the configured channel."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from draft_service.proposer import Proposer
from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc
from minedraft.rpc.server_utils import grpc_errors, timings
from minedraft.rpc.step_stream import serve_step_stream
from minedraft.rpc.worker import (
    Drain,
    ModelWorker,
    WorkerOptions,
    check_batch_id,
    elapsed,
    prompts_and_configs,
    start_worker_server,
)

if TYPE_CHECKING:
    from minedraft.observability.metrics import WorkerMetrics


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, options: WorkerOptions, greedy_drafts: bool = False) -> None:
        self.worker = ModelWorker(options)
        self.proposer = Proposer(self.worker.runner, greedy_drafts=greedy_drafts)

    @grpc_errors
    async def GetInfo(
        self, request: draft_pb2.DraftServiceGetInfoRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftServiceGetInfoResponse:
        return draft_pb2.DraftServiceGetInfoResponse(info=self.worker.info())

    @grpc_errors
    async def SetupChannel(
        self, request: draft_pb2.DraftServiceSetupChannelRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftServiceSetupChannelResponse:
        # Before the export (a no-op after Prepare): an nccl export waits (120 s at most) for the target, which
        # attaches after this reply.
        await self._prepare(request.num_speculative_tokens, request.max_batch_size, request.num_batches)
        handshake = await self.worker.setup_channel(
            request.channel, request.handshake, request.num_speculative_tokens, request.max_batch_size, True
        )
        return draft_pb2.DraftServiceSetupChannelResponse(handshake=handshake)

    @grpc_errors
    async def Prepare(
        self, request: draft_pb2.DraftServicePrepareRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftServicePrepareResponse:
        await self._prepare(request.num_speculative_tokens, request.max_batch_size, request.num_batches)
        return draft_pb2.DraftServicePrepareResponse()

    async def _prepare(self, k: int, max_batch_size: int, num_batches: int) -> None:
        await self.worker.prepare(self.proposer.precapture, k, max_batch_size, num_batches)

    @grpc_errors
    async def Prefill(
        self, request: draft_pb2.DraftServicePrefillRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftServicePrefillResponse:
        start_unix = time.time()
        await self._release_first(request.release_seq_ids)
        seq_ids, prompts, configs = prompts_and_configs(request.sequences)
        limit = self.worker.vocab.logits_size
        if any(t < 0 or t >= limit for prompt in prompts for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {limit})")
        _, queue_s, compute_s = await self.worker.run_timed(self.proposer.prefill, seq_ids, prompts, configs)
        return draft_pb2.DraftServicePrefillResponse(timings=timings(start_unix, compute_s, queue_s=queue_s))

    @grpc_errors
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        return await self._propose_call(request)

    async def ProposeStream(
        self, requests: AsyncIterator[draft_pb2.ProposeStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[draft_pb2.ProposeStreamResponse]:
        async for reply in serve_step_stream(requests, self._propose_call, draft_pb2.ProposeStreamResponse):
            yield reply

    async def _propose_call(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        start_unix = time.time()
        await self._release_first(request.release_seq_ids)
        if not (len(request.seq_ids) == len(request.num_accepted) == len(request.next_token_ids)):
            raise ValueError("seq_ids, num_accepted and next_token_ids must have the same length")
        if request.num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be at least 1")
        check_batch_id(request.batch_id)
        missed = self._missed_tokens(request)
        (payload, channel_s), queue_s, compute_s = await self.worker.run_timed(self._propose, request, missed)
        return draft_pb2.ProposeResponse(drafts=payload, timings=timings(start_unix, compute_s, channel_s, queue_s))

    def _missed_tokens(self, request: draft_pb2.ProposeRequest) -> list[list[int]]:
        """Each sequence's tokens in `missed_token_ids`, checked (none when `num_missed_tokens` is empty)."""
        counts, flat = list(request.num_missed_tokens), list(request.missed_token_ids)
        if not counts and not flat:
            return []
        if len(counts) != len(request.seq_ids):
            raise ValueError("num_missed_tokens must be empty or have one count per sequence in seq_ids")
        if sum(counts) != len(flat):
            raise ValueError(f"num_missed_tokens add up to {sum(counts)}, but missed_token_ids has {len(flat)} ids")
        limit = self.worker.vocab.logits_size
        if any(t < 0 or t >= limit for t in flat):
            raise ValueError(f"missed token ids must be in [0, {limit})")
        ends = list(itertools.accumulate(counts))
        return [flat[end - count : end] for count, end in zip(counts, ends)]

    def _propose(
        self, request: draft_pb2.ProposeRequest, missed: list[list[int]]
    ) -> tuple[common_pb2.DraftPayload, float]:
        channel = self.worker.require_channel()
        proposal = self.proposer.propose(
            list(request.seq_ids),
            torch.tensor(list(request.num_accepted), dtype=torch.long),
            torch.tensor(list(request.next_token_ids), dtype=torch.long),
            request.num_draft_tokens,
            request.batch_id,
            missed,
        )
        start = time.perf_counter()
        payload = channel.send(request.step_id, proposal.draft_ids, proposal.draft_probs)
        return payload, elapsed(start)

    async def _release_first(self, seq_ids: Sequence[int]) -> None:
        """Releases riding on a call: applied before anything in the call can fail, so none is lost."""
        if seq_ids:
            await self.worker.run(self.proposer.release, list(seq_ids))

    @grpc_errors
    async def Release(
        self, request: draft_pb2.DraftServiceReleaseRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.DraftServiceReleaseResponse:
        await self.worker.run(self.proposer.release, list(request.seq_ids))
        return draft_pb2.DraftServiceReleaseResponse(free_slots=self.worker.runner.free_slots)


async def serve(
    options: WorkerOptions,
    port: int,
    host: str = "[::]",
    greedy_drafts: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics: WorkerMetrics | None = None,
) -> tuple[grpc.aio.Server, int, Drain]:
    servicer = DraftServicer(options, greedy_drafts)
    return await start_worker_server(
        servicer.worker,
        lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
        port,
        host,
        interceptors,
        metrics,
    )
