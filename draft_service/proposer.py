"""The draft side of speculative decoding: propose k tokens per sequence, then reconcile with the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minedraft.model_runner import ModelRunner
from minedraft.sampling import STREAM_DRAFT, SamplingConfig, processed_probs, sample_from, seeded_uniform
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
        slots, device = runner.num_slots, runner.device
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)
        self.last_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.last_drafts = torch.zeros(slots, 0, dtype=torch.long, device=device)

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> None:
        rows, lengths, _ = self.table.prefill(seq_ids, prompts, configs)
        self.committed[rows] = lengths
        self.last_k[rows] = 0

    def propose(
        self, seq_ids: Sequence[int], num_accepted: torch.Tensor, next_tokens: torch.Tensor, k: int
    ) -> Proposal:
        """Reconcile every row with the target's last verdict, then draft k tokens for each."""
        rows = self.table.rows(seq_ids)
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

        t = self.table
        temperature = torch.zeros_like(t.temperature[rows]) if self.greedy_drafts else t.temperature[rows]
        greedy = temperature == 0
        if k == 0:
            self._remember(rows, tail[:, :0], 0)
            return Proposal(tail[:, :0], None)
        # The longest row after each step is known from the first: one host sync per proposal, not one per step.
        # (The first step writes both tail positions of every row, valid or not; each later step appends one.)
        lengths = self.runner.cache.lengths[rows]
        widest, longest = torch.stack([(lengths + tail.shape[1]).max(), (lengths + tail_len).max()]).tolist()
        self.committed[rows] = lengths + tail_len
        if bool(greedy.all()):  # no probabilities are made, and none move
            draft_ids = self.runner.greedy_decode(rows, tail, tail_len, k, max(widest, longest + k - 1))
            self._remember(rows, draft_ids, k)
            return Proposal(draft_ids, None)
        drafts, probs = [], []
        inputs, valid = tail, tail_len
        for step in range(k):
            needed = widest if step == 0 else longest + step
            logits = self.runner.forward(rows, inputs, valid, last_only=True, needed=needed)  # [B, V]
            position = self.committed[rows] + step
            q = processed_probs(logits[:, None], temperature, t.top_k[rows], t.top_p[rows])[:, 0]
            u = seeded_uniform(t.seed[rows], position[:, None], STREAM_DRAFT)[:, 0]
            token = torch.where(greedy, logits.argmax(-1), sample_from(q, u))
            probs.append(torch.where(greedy[:, None], torch.nn.functional.one_hot(token, q.shape[-1]).to(q.dtype), q))
            drafts.append(token)
            inputs, valid = token[:, None], torch.ones_like(valid)
        draft_ids = torch.stack(drafts, dim=1)
        self._remember(rows, draft_ids, k)
        return Proposal(draft_ids, torch.stack(probs, dim=1))

    def release(self, seq_ids: Sequence[int]) -> None:
        self.table.remove(seq_ids)

    def _remember(self, rows: torch.Tensor, draft_ids: torch.Tensor, k: int) -> None:
        if self.last_drafts.shape[1] < k:
            grown = torch.zeros(self.runner.num_slots, k, dtype=torch.long, device=self.runner.device)
            grown[:, : self.last_drafts.shape[1]] = self.last_drafts
            self.last_drafts = grown
        self.last_drafts[rows, :k] = draft_ids
        self.last_k[rows] = k
