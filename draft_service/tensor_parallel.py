"""The draft's proposer over tensor-parallel ranks (`minedraft.rpc.ranks`): rank 0's calls mirrored on the others.

Every rank drafts the same tokens (the same logits on each, the draft sampler's uniforms a function of seed and
position), so each keeps the same sequences; only rank 0's drafts leave, over the data plane."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draft_service.proposer import Proposal, Proposer
from minedraft.engine.sampling import SamplingConfig
from minedraft.rpc.ranks import Mirrored, RunCall
from minedraft.rpc.worker import ModelWorker


def make_proposer(worker: ModelWorker, greedy_drafts: bool) -> Proposer:
    return Proposer(worker.runner, greedy_drafts, worker.vocab.eos_token_ids, worker.tokenizer)


def proposer_calls(worker: ModelWorker, greedy_drafts: bool) -> RunCall:
    """How a rank other than 0 runs the proposer calls rank 0 hands on (what they return stays here)."""
    proposer = make_proposer(worker, greedy_drafts)

    def run(name: str, args: Sequence[object]) -> None:
        result = getattr(proposer, name)(*args)
        if isinstance(result, Proposal) and result.upkeep is not None:
            result.upkeep()  # at once: no reply waits here

    return run


class MirroredProposer(Mirrored):
    """The proposer of rank 0: each call handed to the other ranks first, then run here."""

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> list[int]:
        cached: list[int] = self.call("prefill", list(seq_ids), [list(p) for p in prompts], list(configs))
        return cached

    def propose(
        self,
        seq_ids: Sequence[int],
        num_accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        k: int,
        batch_id: int | None = None,
        missed: Sequence[Sequence[int]] = (),
        defer_upkeep: bool = False,
    ) -> Proposal:
        proposal: Proposal = self.call(
            "propose", list(seq_ids), num_accepted, next_tokens, k, batch_id, [list(m) for m in missed], defer_upkeep
        )
        return proposal
