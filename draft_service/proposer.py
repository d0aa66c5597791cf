"""The draft side of speculative decoding: propose k tokens per sequence, then reconcile with the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minedraft.model_runner import Arrangement, Chooser, ModelRunner
from minedraft.sampling import (
    STREAM_DRAFT,
    SamplingConfig,
    greedy_tokens,
    processed_probs,
    sample_from,
    seeded_uniform,
)
from minedraft.sequence_table import SequenceTable


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, k]
    draft_probs: torch.Tensor | None  # [B, k, V] processed q, or None when every row drafted greedily


class Proposer:
    """Holds the draft model's sequences.

    Per row it remembers its last proposal: `committed` (tokens cached when it began) and the drafts. The target's
    answer (accepted count a, emitted token t) then says which cached drafts stay: the cache ran the last proposal's
    drafts 1..k-1, so it keeps min(a, k-1) of them, and after a full accept d_k still has to be run, before t.
    """

    def __init__(self, runner: ModelRunner, greedy_drafts: bool = False) -> None:
        self.runner = runner
        self.table = SequenceTable(runner)
        self.greedy_drafts = greedy_drafts  # one-hot q for every row: no probabilities move, still lossless
        slots, device = runner.num_slots + 1, runner.device  # with the scratch row, as the table
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)
        self.last_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.last_drafts = torch.zeros(slots, 0, dtype=torch.long, device=device)

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> None:
        rows, lengths, _ = self.table.prefill(seq_ids, prompts, configs, _no_outputs, "prefill")
        self.committed[rows] = lengths
        self.last_k[rows] = 0

    def propose(
        self, seq_ids: Sequence[int], num_accepted: torch.Tensor, next_tokens: torch.Tensor, k: int,
        batch_id: int | None = None,
    ) -> Proposal:
        """Reconcile every row with the target's last verdict, then draft k tokens for each (`batch_id`: as in
        `Verifier.verify`)."""
        rows, arrangement = self.table.arranged_rows(seq_ids, batch_id)
        device = self.runner.device
        num_accepted, next_tokens = num_accepted.to(device), next_tokens.to(device)
        last_k = self.last_k[rows]
        self.runner.truncate(rows, self.committed[rows] + torch.minimum(num_accepted, (last_k - 1).clamp(min=0)))
        # Tokens committed but not yet cached: [t], or [d_k, t] after a full accept.
        full = (num_accepted == last_k) & (last_k > 0)
        last_draft = self.last_drafts[rows, (last_k - 1).clamp(min=0)] if self.last_drafts.shape[1] else next_tokens
        tail = torch.stack([torch.where(full, last_draft, next_tokens), next_tokens], dim=1)
        # A target with a padded, wider vocabulary may emit an id the draft cannot embed; any stand-in keeps the
        # output lossless (the target verifies), it only lowers acceptance after such a rare token.
        tail = tail.clamp(max=self.runner.vocab_size - 1)
        tail_len = 1 + full.to(torch.long)

        if k == 0:
            self._remember(rows, tail[:, :0], 0)
            return Proposal(tail[:, :0], None)
        t = self.table
        # The longest row after the last step is known now: one host sync per proposal. (The first step writes both
        # tail positions of every row, valid or not; each later step appends one.)
        lengths = self.runner.cache.lengths[rows]
        widest, longest = torch.stack([(lengths + tail.shape[1]).max(), (lengths + tail_len).max()]).tolist()
        all_greedy, filtered = t.sampling_kind(seq_ids, self.runner.vocab_size)
        all_greedy |= self.greedy_drafts
        self.committed[rows] = lengths + tail_len
        choose, kind = self._chooser(all_greedy, filtered)
        outputs = self.runner.decode(rows, tail, tail_len, k, max(widest, longest + k - 1), choose, kind,
                                     arrangement)
        self._remember(rows, outputs[0], k)
        return Proposal(outputs[0], outputs[1] if len(outputs) > 1 else None)

    def precapture(self, k: int, max_batch: int, batch_ids: Sequence[int] | None = None) -> int:
        """Run every kind of proposal of k tokens in every shape serving can give it (`ModelRunner.precapture`)."""
        kinds = [(True, False)] if self.greedy_drafts else [(True, False), (False, False), (False, True)]
        shapes = 0
        for all_greedy, filtered in kinds:
            choose, kind = self._chooser(all_greedy, filtered)

            def proposal(r: torch.Tensor, i: torch.Tensor, v: torch.Tensor, needed: int, view: Arrangement | None,
                         choose: Chooser = choose, kind: str = kind) -> object:
                return self.runner.decode(r, i, v, k, needed, choose, kind, view)

            shapes += self.runner.precapture(max_batch, 2, proposal, batch_ids)  # a proposal's tail: two tokens
        return shapes

    def _chooser(self, all_greedy: bool, filtered: bool) -> tuple[Chooser, str]:
        """The decode loop's token choice for a batch of this kind, and the kind's name (its graphs' key)."""
        t = self.table

        def choose(r: torch.Tensor, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if all_greedy:  # no probabilities are made, and none move
                return greedy_tokens(logits), None
            temp = t.temperature[r]  # (with greedy_drafts every batch is all-greedy: see propose)
            q = processed_probs(logits[:, None], temp, t.top_k[r], t.top_p[r], filtered)[:, 0]
            u = seeded_uniform(t.seed[r], (self.committed[r] + step)[:, None], STREAM_DRAFT)[:, 0]
            greedy = temp == 0
            token = torch.where(greedy, greedy_tokens(logits), sample_from(q, u))
            one_hot = torch.zeros_like(q).scatter_(-1, token[:, None], 1.0)  # no host sync, unlike F.one_hot
            return token, torch.where(greedy[:, None], one_hot, q)

        return choose, "greedy" if all_greedy else "filtered" if filtered else "sampled"

    def release(self, seq_ids: Sequence[int]) -> None:
        self.table.remove(seq_ids)

    def _remember(self, rows: torch.Tensor, draft_ids: torch.Tensor, k: int) -> None:
        if self.last_drafts.shape[1] < k:
            grown = torch.zeros(len(self.last_drafts), k, dtype=torch.long, device=self.runner.device)
            grown[:, : self.last_drafts.shape[1]] = self.last_drafts
            self.last_drafts = grown
        self.last_drafts[rows, :k] = draft_ids
        self.last_k[rows] = k


def _no_outputs(*_: torch.Tensor) -> list[torch.Tensor]:
    """A draft's prefill only caches the prompts."""
    return []
