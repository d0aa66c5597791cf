"""The target service: gRPC front of the verifier (prefill, verify, release) over the configured channel."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch
from google.protobuf.message import Message

from minedraft.engine.hidden_export import SEQ_ID, latest_rows, layers_named, split_by_layer
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import InternalError, ModelLoadError
from minedraft.proto import common_pb2, generation_pb2, target_pb2, target_pb2_grpc
from minedraft.rpc.options import WorkerOptions
from minedraft.rpc.ranks import RankGroup
from minedraft.rpc.server_utils import grpc_errors, timings
from minedraft.rpc.worker import Drain, ModelWorker, elapsed
from minedraft.rpc.worker_servicer import WorkerServicer, check_batch_id, leased
from target_service.tensor_parallel import MirroredVerifier, make_verifier, verifier_calls
from target_service.verifier import FINISHED_LENGTH, FINISHED_STOP, StepResult, Verifier

if TYPE_CHECKING:
    from minedraft.observability.metrics import WorkerMetrics

log = logging.getLogger(__name__)

_FINISH = {
    FINISHED_STOP: generation_pb2.FINISH_REASON_STOP,
    FINISHED_LENGTH: generation_pb2.FINISH_REASON_LENGTH,
}


def results_proto(seq_ids: list[int], result: StepResult) -> list[target_pb2.SequenceResult]:
    results = [
        target_pb2.SequenceResult(
            seq_id=seq_id,
            token_ids=tokens,
            num_accepted=accepted,
            finish_reason=_FINISH.get(finish, generation_pb2.FINISH_REASON_UNSPECIFIED),
        )
        for seq_id, (tokens, accepted, finish) in zip(seq_ids, result.per_row(), strict=True)
    ]
    # Set only where there is something to say: a verify (most calls) has no cached tokens and mostly no logprobs,
    # and an empty field given to the constructor costs a 32-row reply ~40% more.
    for message, verified in zip(results, result.verified or (), strict=False):
        message.num_verified_drafts = verified
    if result.cached_tokens is not None:
        for message, hits in zip(results, result.cached_tokens, strict=True):
            message.cached_prompt_tokens = hits
    if result.logprobs is not None:
        for message, reported in zip(results, result.logprobs_per_row(), strict=True):
            message.logprobs.extend(
                generation_pb2.TokenLogprob(
                    logprob=lp, top=[generation_pb2.TopLogprob(token_id=i, logprob=v) for i, v in top]
                )
                for lp, top in reported or ()
            )
    for message, prompt in zip(results, result.prompt_logprobs or (), strict=False):
        message.prompt_logprobs.extend(
            generation_pb2.TokenLogprob(
                logprob=lp, top=[generation_pb2.TopLogprob(token_id=i, logprob=v) for i, v in top]
            )
            for lp, top in prompt or ()
        )
    return results


class TargetServicer(WorkerServicer, target_pb2_grpc.TargetServiceServicer):
    """TargetService: the lifecycle RPCs of `WorkerServicer`, and Verify over the verifier."""

    service_name = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
    GetInfoResponse = target_pb2.TargetServiceGetInfoResponse
    SetupChannelResponse = target_pb2.TargetServiceSetupChannelResponse
    PrepareResponse = target_pb2.TargetServicePrepareResponse
    PrefillResponse = target_pb2.TargetServicePrefillResponse
    ReleaseResponse = target_pb2.TargetServiceReleaseResponse
    LeaseResponse = target_pb2.TargetServiceLeaseResponse
    StepStreamResponse = target_pb2.VerifyStreamResponse
    VerifyStream = WorkerServicer.step_stream

    def __init__(self, options: WorkerOptions) -> None:
        if options.tensor_parallel_size < 1:
            raise ModelLoadError(f"--tensor-parallel-size {options.tensor_parallel_size}: give 1 rank or more")
        # The other ranks first: rank 0's forwards (the cache's probe already) meet theirs in each all-reduce.
        ranks = RankGroup(options, verifier_calls, "target service") if options.tensor_parallel_size > 1 else None
        worker = ModelWorker(options, ranks.tp if ranks is not None else None)
        if options.synthetic_acceptance is not None:
            log.warning(
                "BENCHMARK ONLY: drafts are accepted with probability %s whatever the target says; output "
                "is not the target's",
                options.synthetic_acceptance,
            )
        verifier = make_verifier(worker)
        self.one_rank_verifier = verifier if ranks is None else None  # (over ranks, selected verifies run uncaptured)
        self.grammars = verifier.grammars
        self.verifier: Verifier | MirroredVerifier = verifier if ranks is None else MirroredVerifier(verifier, ranks)
        self._warned_blind = False
        super().__init__(worker, self.verifier, ranks)

    def add_to(self, server: grpc.aio.Server) -> None:
        target_pb2_grpc.add_TargetServiceServicer_to_server(self, server)

    async def prepare(self, k: int, max_batch_size: int) -> None:
        """The acceptance compiled (with --compile), then the step shapes run (with --precapture-graphs): each once."""
        await self.worker.run(self.verifier.warm_up, k)
        await super().prepare(k, max_batch_size)

    async def before_prefill(self, configs: list[SamplingConfig]) -> None:
        """The sequences' grammars compiled on a thread of their own (a new one may take a while), while the compute
        thread goes on with the other sequences' steps; the prefill then finds them compiled."""
        for spec in {c.grammar for c in configs if c.grammar is not None}:
            await asyncio.to_thread(self.grammars.compile, spec)

    def prefill(
        self, seq_ids: list[int], prompts: list[list[int]], configs: list[SamplingConfig], request: Any = None
    ) -> dict[str, Any]:
        exporting = self._exporting() if request is not None else ()
        result = self.verifier.prefill(seq_ids, prompts, configs)
        # The results are read on the compute thread: its CUDA stream is the one that made them.
        fields: dict[str, Any] = {"results": results_proto(seq_ids, result)}
        if exporting:
            fields["to_draft"] = self._send_back(0, seq_ids, result, exporting)
        return fields

    def _exporting(self) -> tuple[int, ...]:
        """The layers whose hidden states the draft asked for at the channel's set-up (an EAGLE head), the verifier
        made to export them; none without such a draft."""
        channel = self.worker.channel
        names = [name for name, _, _ in channel.reverse.tensors] if channel is not None and channel.reverse else []
        layers = layers_named(names)
        if not isinstance(self.verifier, Verifier):  # (tensor parallel: its ranks' forwards export nothing yet)
            if layers and not self._warned_blind:
                log.warning("a tensor-parallel target exports no hidden states yet: the EAGLE head drafts blind")
                self._warned_blind = True
            return ()
        if layers != self.verifier.runner.forward_pass.export_layers:
            self.verifier.export_hidden(layers)
        return layers

    def _send_back(
        self, step_id: int, seq_ids: list[int], result: StepResult, layers: tuple[int, ...]
    ) -> common_pb2.TargetPayload:
        """The hidden states a step kept (after `results_proto` read its result), each row labelled with its
        sequence, over the channel's reverse direction in the layout's dtypes."""
        channel = self.worker.require_channel()
        assert channel.reverse is not None
        rows, counts = result.hidden_rows()
        if sum(counts) > channel.reverse.max_rows:  # (a prefill of long prompts: each sequence's latest positions)
            kept = latest_rows(counts, channel.reverse.max_rows)
            log.info(
                "prefill: %d of %d prompt positions' states sent back (the reverse buffer's rows)",
                sum(kept),
                sum(counts),
            )
            ends = torch.tensor(counts).cumsum(0).tolist()
            rows = rows[torch.cat([torch.arange(end - n, end) for end, n in zip(ends, kept)]).to(rows.device)]
            counts = kept
        tensors = split_by_layer(rows, layers)
        tensors[SEQ_ID] = torch.tensor(
            [seq_id for seq_id, n in zip(seq_ids, counts, strict=True) for _ in range(n)], dtype=torch.int64
        )[:, None]
        dtypes = {name: dtype for name, _, dtype in channel.reverse.tensors}
        return channel.send_back(step_id, {name: t.to(dtypes[name]) for name, t in tensors.items()})

    @grpc_errors
    @leased
    async def Prepare(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        """The step shapes run, as `WorkerServicer.Prepare`; with `tetris`, the verifies of selected drafts too."""
        if request.tetris and self.one_rank_verifier is not None:
            verifier = self.one_rank_verifier
            verifier.selected_verifies = True
            if request.num_speculative_tokens:  # (each draft count a Prepare names: a width selected drafts take)
                verifier.verify_widths = tuple(sorted({*verifier.verify_widths, request.num_speculative_tokens}))
        await self.prepare(request.num_speculative_tokens, request.max_batch_size)
        return self.PrepareResponse()

    @grpc_errors
    @leased
    async def Verify(
        self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.VerifyResponse:
        return await self.step(request)

    async def step(self, request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        start_unix = time.time()
        await self.release_first(request.release_seq_ids)
        seq_ids = list(request.seq_ids)
        check_batch_id(request.batch_id)
        (results, to_draft, channel_s), queue_s, compute_s = await self.worker.run_timed(
            self._verify, seq_ids, request.drafts, request.num_draft_tokens, request.batch_id, request.step_id
        )
        timed = timings(start_unix, compute_s, channel_s, queue_s)
        reply = target_pb2.VerifyResponse(results=results, timings=timed, free_blocks=self.worker.runner.free_blocks)
        if to_draft is not None:
            reply.to_draft.CopyFrom(to_draft)
        return reply

    def _verify(
        self, seq_ids: list[int], payload: common_pb2.DraftPayload, k: int, batch_id: int, step_id: int = 0
    ) -> tuple[list[target_pb2.SequenceResult], common_pb2.TargetPayload | None, float]:
        start = time.perf_counter()
        if k == 0:  # target-only decoding: nothing travels
            draft_ids, draft_probs = torch.zeros(len(seq_ids), 0, dtype=torch.long), None
        else:
            draft_ids, draft_probs = self.worker.require_channel().receive(payload)
            if tuple(draft_ids.shape) != (len(seq_ids), k):
                raise InternalError(f"drafts of shape {tuple(draft_ids.shape)} for {len(seq_ids)} sequences, k={k}")
        channel_s = elapsed(start)
        exporting = self._exporting()
        result = self.verifier.verify(seq_ids, draft_ids, draft_probs, batch_id, selected=k > 0 and payload.selected)
        # Read on the compute thread, whose CUDA stream made the results (another stream could read them unfinished).
        results = results_proto(seq_ids, result)
        if not exporting:
            return results, None, channel_s
        start = time.perf_counter()
        to_draft = self._send_back(step_id, seq_ids, result, exporting)
        return results, to_draft, channel_s + elapsed(start)


async def serve(
    options: WorkerOptions,
    port: int,
    host: str = "[::]",
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics: WorkerMetrics | None = None,
) -> tuple[grpc.aio.Server, int, Drain]:
    return await TargetServicer(options).serve(port, host, interceptors, metrics)
