"""The target's verifier over tensor-parallel ranks (`minedraft.rpc.ranks`): rank 0's calls mirrored on the others.

The rejection sampling runs on every rank, identically, rather than once on rank 0: the logits are the same on each
and the sampler's uniforms depend only on seed and position, so every rank commits the same tokens and keeps the
same sequences with no result handed back."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minedraft.engine.sampling import SamplingConfig
from minedraft.rpc.ranks import Mirrored, RunCall
from minedraft.rpc.worker import ModelWorker
from target_service.verifier import StepResult, Verifier


def make_verifier(worker: ModelWorker) -> Verifier:
    options = worker.options
    rates = options.row_acceptance_rates()  # (benchmarks only: each row's rate, picked by its seed)
    synthetic = torch.tensor(rates, device=worker.runner.device) if rates else options.synthetic_acceptance
    verifier = Verifier(worker.runner, worker.vocab.eos_token_ids, synthetic, worker.tokenizer)
    verifier.acceptance.synthetic_by_step = options.synthetic_rate_by == "step"
    return verifier


def verifier_calls(worker: ModelWorker) -> RunCall:
    """How a rank other than 0 runs the verifier calls rank 0 hands on."""
    verifier = make_verifier(worker)

    def run(name: str, args: Sequence[object]) -> None:
        result = getattr(verifier, name)(*args)
        if isinstance(result, StepResult):
            result.per_row()  # what rank 0's reply reads of it, and the blocks given back on reading

    return run


class MirroredVerifier(Mirrored):
    """The verifier of rank 0: each call handed to the other ranks first, then run here."""

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> StepResult:
        result: StepResult = self.call("prefill", list(seq_ids), [list(p) for p in prompts], list(configs))
        return result

    def verify(
        self,
        seq_ids: Sequence[int],
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        batch_id: int | None,
        selected: bool = False,
    ) -> StepResult:
        result: StepResult = self.call("verify", list(seq_ids), draft_ids, draft_probs, batch_id, selected)
        return result

    def warm_up(self, k: int) -> None:
        self.call("warm_up", k)
