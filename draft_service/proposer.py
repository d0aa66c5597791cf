"""The draft side of speculative decoding: propose k tokens per sequence, then reconcile with the target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minedraft.engine.attention import fused_query_tokens
from minedraft.engine.model_runner import Arrangement, Chooser, ModelRunner
from minedraft.engine.sampling import (
    STREAM_DRAFT,
    SamplingConfig,
    greedy_tokens,
    processed_probs,
    sample_from,
    seeded_uniform,
)
from minedraft.engine.sequence_table import SequenceTable


@dataclass
class Proposal:
    draft_ids: torch.Tensor  # [B, k]
    draft_probs: torch.Tensor | None  # [B, k, V] processed q, or None when every row drafted greedily


class Proposer:
    """Holds the draft model's sequences.

    Per row it remembers its last proposal: `committed` (tokens cached when it began), how many drafts it made and
    the last of them, d_k. The target's answer (accepted count a, emitted token t) then says which cached drafts
    stay: the cache ran the last proposal's drafts 1..k-1, so it keeps min(a, k-1) of them, and after a full accept
    d_k still has to be run, before t.
    """

    def __init__(self, runner: ModelRunner, greedy_drafts: bool = False) -> None:
        self.runner = runner
        self.table = SequenceTable(runner)
        self.greedy_drafts = greedy_drafts  # one-hot q for every row: no probabilities move, still lossless
        slots, device = runner.num_slots + 1, runner.device  # with the scratch row, as the table
        self.committed = torch.zeros(slots, dtype=torch.long, device=device)
        self.last_k = torch.zeros(slots, dtype=torch.long, device=device)
        self.final_draft = torch.zeros(slots, dtype=torch.long, device=device)
        # Host copies of `committed` and `last_k`: a proposal's key length without waiting for the device.
        self.committed_host = [0] * slots
        self.last_k_host = [0] * slots

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> None:
        rows, lengths, _ = self.table.prefill(seq_ids, prompts, configs, _no_outputs, "prefill")
        self.committed[rows] = lengths
        self.last_k[rows] = 0
        for row, prompt in zip(self.table.row_list(seq_ids), prompts, strict=True):
            self.committed_host[row], self.last_k_host[row] = len(prompt), 0

    def propose(
        self,
        seq_ids: Sequence[int],
        num_accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        k: int,
        batch_id: int | None = None,
        missed: Sequence[Sequence[int]] = (),
    ) -> Proposal:
        """Reconcile every row with the target's last verdict, then draft k tokens for each (`batch_id`: as in
        `Verifier.verify`), all in the proposal's CUDA graph. `num_accepted` and `next_tokens` are host tensors.

        `missed` (per row, or empty): tokens the target emitted before `next_tokens` that this draft was not given,
        since the coordinator decoded without drafts meanwhile (`_catch_up`)."""
        if k < 1:
            raise ValueError("a proposal drafts at least one token")
        if any(missed):
            self._catch_up(seq_ids, num_accepted.tolist(), missed)
        host_rows, rows, arrangement = self.table.arranged_rows(seq_ids, batch_id)
        # The lengths the proposal's steps reach, from the host copies: the first step writes both tail positions
        # of every row, valid or not, each later step appends one.
        kept_and_tail = [self._kept_and_tail(row, accepted) for row, accepted in zip(host_rows, num_accepted.tolist())]
        widest = max(kept for kept, _ in kept_and_tail) + 2
        longest = max(kept + tail for kept, tail in kept_and_tail)
        all_greedy, filtered = self.table.sampling_kind(seq_ids, self.runner.vocab_size)
        choose, kind = self._chooser(all_greedy or self.greedy_drafts, filtered, k)
        verdicts = torch.stack([num_accepted, next_tokens], dim=1)  # copied straight into the graph's inputs
        outputs = self.runner.decode(
            rows, [verdicts], k, max(widest, longest + k - 1), self._start, choose, kind, arrangement
        )
        for row, (kept, tail) in zip(host_rows, kept_and_tail):
            self.committed_host[row], self.last_k_host[row] = kept + tail, k
        return Proposal(outputs[0], outputs[1] if len(outputs) > 1 else None)

    def _catch_up(self, seq_ids: Sequence[int], num_accepted: list[int], missed: Sequence[Sequence[int]]) -> None:
        """Rows that missed tokens: the verdict on their last proposal applied, then what it leaves uncached (d_k
        after a full accept) and the missed tokens cached, in one eager forward (as a prefill: a graph per width
        would be captured mid-load). Each row is left as a prefill leaves it, nothing drafted, so that the
        proposal's graph feeds it `next_tokens` alone. Only after the coordinator decoded without drafts, which it
        does in spells (`SpeculationPolicy`): one forward per spell, off the proposals' graphs."""
        lagging = [i for i, tokens in enumerate(missed) if tokens]
        host_rows = self.table.row_list([seq_ids[i] for i in lagging])
        device = self.runner.device
        rows = torch.tensor(host_rows, dtype=torch.long, device=device)
        final_drafts = self.final_draft[rows].tolist()
        kept, appended = [], []
        for i, row, final_draft in zip(lagging, host_rows, final_drafts):
            keep, tail = self._kept_and_tail(row, num_accepted[i])
            kept.append(keep)
            appended.append(([final_draft] if tail == 2 else []) + list(missed[i]))
        width = max(len(t) for t in appended)
        if device.type == "cuda":  # wide enough for the prefills' attention (`fused_query_tokens`), within the rows
            width = max(width, min(fused_query_tokens(self.runner.model.config), self.runner.max_len - max(kept)))
        ids = torch.zeros(len(lagging), width, dtype=torch.long)
        for b, tokens in enumerate(appended):
            ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        ids = ids.clamp(max=self.runner.vocab_size - 1)  # (as `_start`: a wider target vocabulary)
        lengths = [keep + len(tokens) for keep, tokens in zip(kept, appended)]
        self.runner.truncate(rows, torch.tensor(kept, dtype=torch.long, device=device))
        self.runner.score(
            rows,
            [ids.to(device), torch.tensor([len(t) for t in appended], device=device)],
            _no_outputs,
            "catch-up",
            needed=max(kept) + width,
            tokens=width,
            last_only=True,
        )
        self.committed[rows] = torch.tensor(lengths, dtype=torch.long, device=device)
        self.last_k[rows] = 0
        for row, length in zip(host_rows, lengths):
            self.committed_host[row], self.last_k_host[row] = length, 0

    def precapture(self, k: int, max_batch: int, batch_ids: Sequence[int] | None = None) -> int:
        """Run every kind of proposal of k tokens in every shape serving can give it (`ModelRunner.precapture`)."""
        kinds = [(True, False)] if self.greedy_drafts else [(True, False), (False, False), (False, True)]
        shapes = 0
        for all_greedy, filtered in kinds:
            choose, kind = self._chooser(all_greedy, filtered, k)

            def proposal(
                r: torch.Tensor,
                i: torch.Tensor,
                v: torch.Tensor,
                needed: int,
                view: Arrangement | None,
                choose: Chooser = choose,
                kind: str = kind,
            ) -> object:
                verdicts = torch.zeros(len(r), 2, dtype=torch.long, device=r.device)
                return self.runner.decode(r, [verdicts], k, needed, self._start, choose, kind, view)

            shapes += self.runner.precapture(max_batch, 2, proposal, batch_ids)  # a proposal's tail: two tokens
        return shapes

    def _kept_and_tail(self, row: int, accepted: int) -> tuple[int, int]:
        """(tokens the row's cache keeps, tokens committed but not cached yet) after the target's verdict."""
        last_k = self.last_k_host[row]
        return self.committed_host[row] + min(accepted, max(last_k - 1, 0)), 2 if accepted == last_k > 0 else 1

    def _start(self, rows: torch.Tensor, verdicts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inside the proposal's graph: roll each row back to what the target kept; the first step's tokens are
        those committed but not cached: [t], or [d_k, t] after a full accept."""
        num_accepted, next_tokens = verdicts[:, 0], verdicts[:, 1]
        last_k = self.last_k[rows]
        kept = self.committed[rows] + torch.minimum(num_accepted, (last_k - 1).clamp(min=0))
        self.runner.truncate(rows, kept)
        full = (num_accepted == last_k) & (last_k > 0)
        tail = torch.stack([torch.where(full, self.final_draft[rows], next_tokens), next_tokens], dim=1)
        # A target with a padded, wider vocabulary may emit an id the draft cannot embed; any stand-in keeps the
        # output lossless (the target verifies), it only lowers acceptance after such a rare token.
        tail = tail.clamp(max=self.runner.vocab_size - 1)
        tail_len = 1 + full.to(torch.long)
        self.committed[rows] = kept + tail_len
        # Padding rows: the scratch row stays empty. (An assignment of 0 would copy it from the host: not in a graph.)
        self.committed.narrow(0, self.runner.scratch_row, 1).zero_()
        return tail, tail_len

    def _chooser(self, all_greedy: bool, filtered: bool, k: int) -> tuple[Chooser, str]:
        """The decode loop's token choice for a batch of this kind, and the kind's name (its graphs' key); the last
        of k choices is remembered as the row's d_k."""
        t = self.table

        def choose(r: torch.Tensor, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if all_greedy:  # no probabilities are made, and none move
                token, q = greedy_tokens(logits), None
            else:
                temp = t.temperature[r]  # (with greedy_drafts every batch is all-greedy: see propose)
                probs = processed_probs(logits[:, None], temp, t.top_k[r], t.top_p[r], filtered)[:, 0]
                u = seeded_uniform(t.seed_key[r], (self.committed[r] + step)[:, None], STREAM_DRAFT)[:, 0]
                greedy = temp == 0
                token = torch.where(greedy, greedy_tokens(logits), sample_from(probs, u))
                one_hot = torch.zeros_like(probs).scatter_(-1, token[:, None], 1.0)  # no host sync, unlike F.one_hot
                q = torch.where(greedy[:, None], one_hot, probs)
            if step == k - 1:
                self.final_draft[r] = token
                self.last_k.index_fill_(0, r, k)  # (an assignment would copy k from the host: not in a graph)
            return token, q

        return choose, "greedy" if all_greedy else "filtered" if filtered else "sampled"

    def release(self, seq_ids: Sequence[int]) -> None:
        self.table.remove(seq_ids)


def _no_outputs(*_: torch.Tensor) -> list[torch.Tensor]:
    """A draft's prefill only caches the prompts."""
    return []
