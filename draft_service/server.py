"""The draft service: gRPC front of the proposer; drafts leave through the configured channel."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc
import torch
from google.protobuf.message import Message

from draft_service.drafter import MODEL_FREE_METHODS, Drafter, resolve_method
from draft_service.eagle import EagleProposer
from draft_service.eagle_head import load_eagle_head
from draft_service.ngram import NgramProposer
from draft_service.proposer import Proposer
from draft_service.tensor_parallel import MirroredProposer, make_proposer, proposer_calls
from draft_service.tetris import draft_logprobs, selected_drafts
from minedraft.channels.base import ReverseLayout
from minedraft.engine.grammar import Grammars
from minedraft.engine.hidden_export import SEQ_ID, joined_for_head, reverse_rows, tensor_names
from minedraft.engine.models import resolve_dtype
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import InvalidRequest, ModelLoadError
from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc
from minedraft.rpc.options import WorkerOptions
from minedraft.rpc.ranks import RankGroup
from minedraft.rpc.server_utils import grpc_errors, timings
from minedraft.rpc.worker import Drain, ModelWorker, elapsed
from minedraft.rpc.worker_servicer import WorkerServicer, check_batch_id, leased

if TYPE_CHECKING:
    from minedraft.observability.metrics import WorkerMetrics


class DraftServicer(WorkerServicer, draft_pb2_grpc.DraftServiceServicer):
    """DraftService: the lifecycle RPCs of `WorkerServicer`, and Propose over its drafter (`--speculative-method`)."""

    service_name = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
    exports_channel = True
    GetInfoResponse = draft_pb2.DraftServiceGetInfoResponse
    SetupChannelResponse = draft_pb2.DraftServiceSetupChannelResponse
    PrepareResponse = draft_pb2.DraftServicePrepareResponse
    PrefillResponse = draft_pb2.DraftServicePrefillResponse
    ReleaseResponse = draft_pb2.DraftServiceReleaseResponse
    LeaseResponse = draft_pb2.DraftServiceLeaseResponse
    StepStreamResponse = draft_pb2.ProposeStreamResponse
    ProposeStream = WorkerServicer.step_stream

    def __init__(self, options: WorkerOptions, greedy_drafts: bool = False) -> None:
        if options.tensor_parallel_size < 1:
            raise ModelLoadError(f"--tensor-parallel-size {options.tensor_parallel_size}: give 1 rank or more")
        self.method = resolve_method(options.speculative_method, options.model)
        self.proposer: Drafter
        self.eagle: EagleProposer | None = None
        self.grammars: Grammars | None = (
            None  # (a draft model's, which masks its drafts; other drafters draft unmasked)
        )
        self.scorer: Proposer | None = None  # the drafter that scores its drafts for TETRIS (one device's draft model)
        if self.method in ("eagle", "eagle3"):
            if options.tensor_parallel_size > 1:
                raise ModelLoadError(f"--speculative-method {self.method}: an EAGLE head runs on one device")
            target_dir = options.target_model_for_draft or ""
            if not target_dir:
                raise ModelLoadError(
                    f"--speculative-method {self.method}: give --target-model-for-draft, the target's model directory "
                    "(the head's embeddings are the target's)"
                )
            worker = ModelWorker(options, vocab_from=target_dir, device=options.device)
            head, spec = load_eagle_head(
                options.model, target_dir, self.method == "eagle3", resolve_dtype(options.dtype, options.device)
            )
            self.eagle = EagleProposer(
                head.to(worker.device), spec, worker.num_slots, worker.max_len, cuda_graphs=options.cuda_graphs
            )
            self.proposer = self.eagle
            super().__init__(worker, self.eagle)
            return
        if self.method in MODEL_FREE_METHODS:
            if options.tensor_parallel_size > 1:
                raise ModelLoadError(f"--speculative-method {self.method} loads no model: give no tensor parallelism")
            worker = ModelWorker(options, vocab_from=options.target_model_for_draft or options.model)
            ngram = NgramProposer(worker.num_slots, worker.max_len, options.ngram_min, options.ngram_max)
            self.proposer = ngram
            super().__init__(worker, ngram)
            return
        # The other ranks first: rank 0's forwards (the cache's probe already) meet theirs in each all-reduce.
        calls = functools.partial(proposer_calls, greedy_drafts=greedy_drafts)
        ranks = RankGroup(options, calls, "draft service") if options.tensor_parallel_size > 1 else None
        worker = ModelWorker(options, ranks.tp if ranks is not None else None)
        proposer = make_proposer(worker, greedy_drafts)
        if ranks is None:  # (over ranks a proposal's drafts are scored from their probabilities, or uniformly)
            self.scorer = proposer
            rates = options.row_acceptance_rates()
            if rates:
                proposer.synthetic_rates = torch.tensor(rates, dtype=torch.float32, device=worker.runner.device)
                proposer.synthetic_by_step = options.synthetic_rate_by == "step"
        self.grammars = proposer.grammars
        self.proposer = proposer if ranks is None else MirroredProposer(proposer, ranks)
        super().__init__(worker, self.proposer, ranks)

    def add_to(self, server: grpc.aio.Server) -> None:
        draft_pb2_grpc.add_DraftServiceServicer_to_server(self, server)

    async def before_prefill(self, configs: list[SamplingConfig]) -> None:
        """The sequences' grammars (whose masks the drafts take) compiled on a thread of their own, while the compute
        thread goes on with the other sequences' proposals."""
        if self.grammars is not None:
            for spec in {c.grammar for c in configs if c.grammar is not None}:
                await asyncio.to_thread(self.grammars.compile, spec)

    @grpc_errors
    @leased
    async def Prepare(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        """The step shapes run, as `WorkerServicer.Prepare`; with `tetris`, the proposals' graphs score the drafts."""
        if request.tetris and self.scorer is not None:
            self.scorer.scores_drafts = True
        await self.prepare(request.num_speculative_tokens, request.max_batch_size)
        return self.PrepareResponse()

    @grpc_errors
    async def GetInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Message:
        info = self.worker.info()
        info.reads_target_states = self.eagle is not None
        return self.GetInfoResponse(info=info)

    def reverse_layout(self, k: int, max_batch_size: int) -> ReverseLayout | None:
        """An EAGLE head's: each layer it reads, [rows, H] in the head's dtype, and each row's sequence id; as many
        rows as a verify's kept positions or one long prompt (`reverse_rows`): a prefill of more sends each
        sequence's latest positions only (the target's `_send_back`)."""
        if self.eagle is None:
            return None
        width = self.eagle.head.embed.embedding_dim  # (the target's embeddings: its hidden size)
        dtype = self.eagle.head.fc.weight.dtype
        hidden = tuple((name, width, dtype) for name in tensor_names(self.eagle.spec.layers))
        rows = reverse_rows(max_batch_size, k, self.worker.max_len)
        return ReverseLayout(max_rows=rows, tensors=(*hidden, (SEQ_ID, 1, torch.int64)))

    def _take_states(self, payload: common_pb2.TargetPayload, admitting: bool = False) -> None:
        """The target's hidden states a Prefill or Propose brought, handed to the EAGLE head."""
        assert self.eagle is not None
        tensors = self.worker.require_channel().receive_back(payload)
        rows = joined_for_head(tensors, self.eagle.spec.layers)
        self.eagle.add_states(tensors[SEQ_ID][:, 0].tolist(), rows, admitting)

    def prefill(
        self, seq_ids: list[int], prompts: list[list[int]], configs: list[SamplingConfig], request: Any = None
    ) -> dict[str, Any]:
        if self.eagle is not None and request is not None and request.HasField("from_target"):
            self._take_states(request.from_target, admitting=True)
        return {"cached_prompt_tokens": self.proposer.prefill(seq_ids, prompts, configs)}

    @grpc_errors
    @leased
    async def Propose(
        self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext
    ) -> draft_pb2.ProposeResponse:
        try:
            return await self.step(request)
        finally:  # on the loop's next turn: grpc has begun sending the reply by then
            asyncio.get_running_loop().call_soon(self.worker.replied, request)

    async def step(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        start_unix = time.time()
        await self.release_first(request.release_seq_ids)
        if not (len(request.seq_ids) == len(request.num_accepted) == len(request.next_token_ids)):
            raise InvalidRequest("seq_ids, num_accepted and next_token_ids must have the same length")
        if request.num_draft_tokens < 1:
            raise InvalidRequest("num_draft_tokens must be at least 1")
        check_batch_id(request.batch_id)
        missed = self._missed_tokens(request)
        (payload, channel_s), queue_s, compute_s = await self.worker.run_timed(self._propose, request, missed)
        timed = timings(start_unix, compute_s, channel_s, queue_s)
        return draft_pb2.ProposeResponse(drafts=payload, timings=timed, free_blocks=self.worker.free_blocks)

    def _missed_tokens(self, request: draft_pb2.ProposeRequest) -> list[list[int]]:
        """Each sequence's tokens in `missed_token_ids`, checked (none when `num_missed_tokens` is empty)."""
        counts, flat = list(request.num_missed_tokens), list(request.missed_token_ids)
        if not counts and not flat:
            return []
        if len(counts) != len(request.seq_ids):
            raise InvalidRequest("num_missed_tokens must be empty or have one count per sequence in seq_ids")
        if sum(counts) != len(flat):
            raise InvalidRequest(f"num_missed_tokens add up to {sum(counts)}, but missed_token_ids has {len(flat)} ids")
        limit = self.worker.vocab.logits_size
        if any(t < 0 or t >= limit for t in flat):
            raise InvalidRequest(f"missed token ids must be in [0, {limit})")
        ends = list(itertools.accumulate(counts))
        return [flat[end - count : end] for count, end in zip(counts, ends)]

    def _propose(
        self, request: draft_pb2.ProposeRequest, missed: list[list[int]]
    ) -> tuple[common_pb2.DraftPayload, float]:
        channel = self.worker.require_channel()
        if self.eagle is not None and request.HasField("from_target"):
            self._take_states(request.from_target)
        proposal = self.proposer.propose(
            list(request.seq_ids),
            torch.tensor(list(request.num_accepted), dtype=torch.long),
            torch.tensor(list(request.next_token_ids), dtype=torch.long),
            request.num_draft_tokens,
            request.batch_id,
            missed,
            defer_upkeep=True,
        )
        draft_ids = proposal.draft_ids
        if request.verify_token_budget:  # TETRIS: each row's kept prefix, the rest -1 (design section 14)
            scores = draft_logprobs(draft_ids, proposal.draft_probs, proposal.token_logprobs)
            draft_ids = selected_drafts(draft_ids, scores, request.verify_token_budget)
        start = time.perf_counter()
        payload = channel.send(request.step_id, draft_ids, proposal.draft_probs)
        payload.selected = bool(request.verify_token_budget)
        if proposal.upkeep is not None:
            self.worker.after_reply(request, proposal.upkeep)
        return payload, elapsed(start)


async def serve(
    options: WorkerOptions,
    port: int,
    host: str = "[::]",
    greedy_drafts: bool = False,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    metrics: WorkerMetrics | None = None,
) -> tuple[grpc.aio.Server, int, Drain]:
    return await DraftServicer(options, greedy_drafts).serve(port, host, interceptors, metrics)
