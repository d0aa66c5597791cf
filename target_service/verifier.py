"""The target side of speculative decoding: prefill, one-pass verification, commit and rollback."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minedraft.model_runner import Arrangement, ModelRunner
from minedraft.sampling import SamplingConfig
from minedraft.sequence_table import SequenceTable
from target_service.rejection_sampler import RowParams, SamplerOutput, rejection_sample

RUNNING, FINISHED_STOP, FINISHED_LENGTH = 0, 1, 2


@dataclass
class StepResult:
    """Per row of a prefill or verify: the tokens it emits and whether the sequence is done."""

    tokens: torch.Tensor  # [B, m]; row b emits tokens[b, :num_emitted[b]]
    num_emitted: torch.Tensor  # [B]
    num_accepted: torch.Tensor  # [B] drafts accepted (0 for prefill and AR)
    finish: torch.Tensor  # [B] RUNNING, FINISHED_STOP or FINISHED_LENGTH

    def per_row(self) -> list[tuple[list[int], int, int]]:
        """(tokens, accepted, finish) per row, on the host: the one device-to-host copy of a step."""
        counts = torch.stack([self.num_emitted, self.num_accepted, self.finish], dim=1).to(self.tokens.dtype)
        return [
            (row[:n], a, f)
            for n, a, f, *row in torch.cat([counts, self.tokens], dim=1).tolist()
        ]


class Verifier:
    """Holds the target model's sequences. Invariant: each row's cache holds every committed token but the last,
    which waits in `pending` to be the first input of the next verify."""

    def __init__(
        self, runner: ModelRunner, eos_token_ids: Sequence[int], synthetic_acceptance: float | None = None
    ) -> None:
        self.runner = runner
        self.synthetic_acceptance = synthetic_acceptance  # benchmarks only: see rejection_sample
        self.table = SequenceTable(runner)
        self.pending = torch.zeros(runner.num_slots, dtype=torch.long, device=runner.device)
        self.eos = torch.tensor(sorted(set(eos_token_ids)) or [-1], dtype=torch.long, device=runner.device)

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> StepResult:
        """Cache the prompts and sample each sequence's first token (time to first token ends here)."""
        rows, lengths, logits = self.table.prefill(seq_ids, prompts, configs)
        no_drafts = torch.zeros(len(prompts), 0, dtype=torch.long, device=self.runner.device)
        all_greedy, filtered = self.table.sampling_kind(seq_ids, logits.shape[-1])
        sampled = rejection_sample(logits[:, None], no_drafts, None, self._params(rows), lengths, None,
                                   all_greedy=all_greedy, filtered=filtered)
        # As if the last prompt token had been pending: the same commit as a verify step.
        return self._commit(rows, lengths - 1, sampled)

    def verify(self, seq_ids: Sequence[int], draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
               batch_id: int | None = None) -> StepResult:
        """Score `[pending, d_1..d_k]` of every row in one forward, accept a prefix, commit it, roll back the rest.

        k = 0 is plain autoregressive decoding through the same path. A `batch_id` (0 or 1) keeps the batch's K/V in
        a block of cache rows of its own, read without a copy.
        """
        rows, arrangement = self.table.arranged_rows(seq_ids, batch_id)
        starts = self.runner.cache.lengths[rows]
        k = draft_ids.shape[1]
        inputs = torch.cat([self.pending[rows][:, None], draft_ids.to(self.runner.device)], dim=1)
        logits = self.runner.forward(rows, inputs, torch.full_like(starts, k + 1), arrangement=arrangement)
        probs = None if draft_probs is None else draft_probs.to(self.runner.device)
        all_greedy, filtered = self.table.sampling_kind(seq_ids, logits.shape[-1])
        sampled = rejection_sample(logits, inputs[:, 1:], probs, self._params(rows), starts + 1,
                                   self.synthetic_acceptance, all_greedy=all_greedy, filtered=filtered)
        return self._commit(rows, starts, sampled)

    def release(self, seq_ids: Sequence[int]) -> None:
        self.table.remove(seq_ids)

    def precapture(self, k: int, max_batch: int, batch_ids: Sequence[int] | None = None) -> int:
        """Run the verify forward of k drafts in every shape serving can give it (`ModelRunner.precapture`)."""
        def verify(r: torch.Tensor, i: torch.Tensor, v: torch.Tensor, needed: int, view: Arrangement | None
                   ) -> object:
            return self.runner.forward(r, i, v, needed=needed, arrangement=view)

        return self.runner.precapture(max_batch, k + 1, verify, batch_ids)

    def _params(self, rows: torch.Tensor) -> RowParams:
        t = self.table
        return RowParams(t.temperature[rows], t.top_k[rows], t.top_p[rows], t.seed[rows])

    def _commit(self, rows: torch.Tensor, starts: torch.Tensor, sampled: SamplerOutput) -> StepResult:
        """Trim at stop tokens and the length budget; keep the cache of what was emitted, drop the rest."""
        tokens, width = sampled.tokens, sampled.tokens.shape[1]
        emitted = sampled.num_accepted + 1
        t = self.table
        is_eos = torch.isin(tokens, self.eos) & ~t.ignore_eos[rows][:, None]
        is_stop = is_eos | (tokens[:, :, None] == t.stop_ids[rows][:, None, :]).any(-1)
        is_stop &= torch.arange(width, device=tokens.device)[None, :] < emitted[:, None]
        first_stop = torch.where(is_stop.any(-1), is_stop.to(torch.long).argmax(-1), width)
        budget = t.max_tokens[rows] - t.generated[rows]
        keep = torch.minimum(torch.minimum(emitted, first_stop + 1), budget)
        finish = torch.where(
            first_stop < keep, FINISHED_STOP, torch.where(keep >= budget, FINISHED_LENGTH, RUNNING)
        )
        t.generated[rows] += keep
        # Cached now: old pending + the first keep-1 emitted tokens; the last emitted one becomes pending.
        self.runner.truncate(rows, starts + keep)
        self.pending[rows] = tokens[torch.arange(len(rows), device=tokens.device), keep - 1]
        return StepResult(tokens, keep, sampled.num_accepted, finish)
