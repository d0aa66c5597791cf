"""The target service: gRPC front of the verifier (prefill, verify, release) over the configured channel."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc
import torch

from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import common_pb2, generation_pb2, target_pb2, target_pb2_grpc
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
from target_service.verifier import FINISHED_LENGTH, FINISHED_STOP, StepResult, Verifier

if TYPE_CHECKING:
    from minedraft.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)

_FINISH = {
    FINISHED_STOP: generation_pb2.FINISH_REASON_STOP,
    FINISHED_LENGTH: generation_pb2.FINISH_REASON_LENGTH,
}


def results_proto(seq_ids: list[int], result: StepResult) -> list[target_pb2.SequenceResult]:
    return [
        target_pb2.SequenceResult(
            seq_id=seq_id,
            token_ids=tokens,
            num_accepted=accepted,
            finish_reason=_FINISH.get(finish, generation_pb2.FINISH_REASON_UNSPECIFIED),
        )
        for seq_id, (tokens, accepted, finish) in zip(seq_ids, result.per_row())
    ]


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, options: WorkerOptions) -> None:
        self.worker = ModelWorker(options)
        if options.synthetic_acceptance is not None:
            log.warning(
                "BENCHMARK ONLY: drafts are accepted with probability %s whatever the target says; output "
                "is not the target's",
                options.synthetic_acceptance,
            )
        self.verifier = Verifier(self.worker.runner, self.worker.vocab.eos_token_ids, options.synthetic_acceptance)

    @grpc_errors
    async def GetInfo(
        self, request: target_pb2.TargetServiceGetInfoRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetServiceGetInfoResponse:
        return target_pb2.TargetServiceGetInfoResponse(info=self.worker.info())

    @grpc_errors
    async def SetupChannel(
        self, request: target_pb2.TargetServiceSetupChannelRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetServiceSetupChannelResponse:
        handshake = await self.worker.setup_channel(
            request.channel, request.handshake, request.num_speculative_tokens, request.max_batch_size, False
        )
        # After the attach (a no-op after Prepare): the draft's side of an nccl rendezvous is waiting for it.
        await self._prepare(request.num_speculative_tokens, request.max_batch_size, request.num_batches)
        return target_pb2.TargetServiceSetupChannelResponse(handshake=handshake)

    @grpc_errors
    async def Prepare(
        self, request: target_pb2.TargetServicePrepareRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetServicePrepareResponse:
        await self._prepare(request.num_speculative_tokens, request.max_batch_size, request.num_batches)
        return target_pb2.TargetServicePrepareResponse()

    async def _prepare(self, k: int, max_batch_size: int, num_batches: int) -> None:
        """The acceptance compiled (with --compile), then the step shapes run (with --precapture-graphs): each once."""
        await self.worker.run(self.verifier.warm_up, k)
        await self.worker.prepare(self.verifier.precapture, k, max_batch_size, num_batches)

    @grpc_errors
    async def Prefill(
        self, request: target_pb2.TargetServicePrefillRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetServicePrefillResponse:
        start_unix = time.time()
        await self._release_first(request.release_seq_ids)
        seq_ids, prompts, configs = prompts_and_configs(request.sequences)
        limit = self.worker.vocab.logits_size
        if any(t < 0 or t >= limit for prompt in prompts for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {limit})")
        results, queue_s, compute_s = await self.worker.run_timed(self._prefill, seq_ids, prompts, configs)
        return target_pb2.TargetServicePrefillResponse(
            results=results, timings=timings(start_unix, compute_s, queue_s=queue_s)
        )

    def _prefill(
        self, seq_ids: list[int], prompts: list[list[int]], configs: list[SamplingConfig]
    ) -> list[target_pb2.SequenceResult]:
        # The results are read on the compute thread: its CUDA stream is the one that made them.
        return results_proto(seq_ids, self.verifier.prefill(seq_ids, prompts, configs))

    @grpc_errors
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        return await self._verify_call(request)

    async def VerifyStream(
        self, requests: AsyncIterator[target_pb2.VerifyStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.VerifyStreamResponse]:
        async for reply in serve_step_stream(requests, self._verify_call, target_pb2.VerifyStreamResponse):
            yield reply

    async def _verify_call(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        start_unix = time.time()
        await self._release_first(request.release_seq_ids)
        seq_ids = list(request.seq_ids)
        check_batch_id(request.batch_id)
        (results, channel_s), queue_s, compute_s = await self.worker.run_timed(
            self._verify, seq_ids, request.drafts, request.num_draft_tokens, request.batch_id
        )
        return target_pb2.VerifyResponse(results=results, timings=timings(start_unix, compute_s, channel_s, queue_s))

    def _verify(
        self, seq_ids: list[int], payload: common_pb2.DraftPayload, k: int, batch_id: int
    ) -> tuple[list[target_pb2.SequenceResult], float]:
        start = time.perf_counter()
        if k == 0:  # target-only decoding: nothing travels
            draft_ids, draft_probs = torch.zeros(len(seq_ids), 0, dtype=torch.long), None
        else:
            draft_ids, draft_probs = self.worker.require_channel().receive(payload)
            if tuple(draft_ids.shape) != (len(seq_ids), k):
                raise ValueError(f"drafts of shape {tuple(draft_ids.shape)} for {len(seq_ids)} sequences, k={k}")
        channel_s = elapsed(start)
        # Read on the compute thread, whose CUDA stream made the results (another stream could read them unfinished).
        return results_proto(seq_ids, self.verifier.verify(seq_ids, draft_ids, draft_probs, batch_id)), channel_s

    async def _release_first(self, seq_ids: Sequence[int]) -> None:
        """Releases riding on a call: applied before anything in the call can fail, so none is lost."""
        if seq_ids:
            await self.worker.run(self.verifier.release, list(seq_ids))

    @grpc_errors
    async def Release(
        self, request: target_pb2.TargetServiceReleaseRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.TargetServiceReleaseResponse:
        await self.worker.run(self.verifier.release, list(request.seq_ids))
        return target_pb2.TargetServiceReleaseResponse(free_slots=self.worker.runner.free_slots)


async def serve(
    options: WorkerOptions,
    port: int,
    host: str = "[::]",
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics: WorkerMetrics | None = None,
) -> tuple[grpc.aio.Server, int, Drain]:
    servicer = TargetServicer(options)
    return await start_worker_server(
        servicer.worker,
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
        target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name,
        port,
        host,
        interceptors,
        metrics,
    )
