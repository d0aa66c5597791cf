"""N-gram prompt lookup: drafts the continuation of the longest recent match of a sequence's last tokens in its own
prompt and output, with no model (the draft service runs it on the CPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draft_service.drafter import Proposal, check_proposal
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import CapacityError, InvalidRequest


def ngram_lookup(history: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """Per row of `history` `[B, L]` (its first `lengths[b]` tokens valid, at least one): the k tokens that followed
    the latest earlier occurrence of its last n tokens, for the largest n in [min_n, max_n] that occurs, cut at the
    row's end and padded with the continuation's last token; a row with no match drafts its last token k times.
    Vectorized over the batch: for each n, every window of every row compared at once."""
    batch, width = history.shape
    rows = torch.arange(batch)
    last = history[rows, (lengths - 1).clamp(min=0)]
    start = torch.full((batch,), -1, dtype=torch.long)  # where the chosen continuation begins (-1: none yet)
    positions = torch.arange(width)
    for n in range(min(max_n, width - 1), min_n - 1, -1):
        suffix_at = (lengths - n).clamp(min=0)[:, None] + torch.arange(n)  # [B, n]
        suffix = history.gather(1, suffix_at.clamp(max=width - 1))
        windows = history.unfold(1, n, 1)  # [B, L - n + 1, n]: the window at s holds tokens s .. s + n - 1
        matches = (windows == suffix[:, None, :]).all(-1)
        # An earlier occurrence: it ends before the row's last token, so at least one token follows it.
        earlier = positions[: windows.shape[1]][None, :] <= (lengths - n - 1)[:, None]
        found = matches & earlier
        latest = torch.where(found, positions[: windows.shape[1]][None, :], -1).amax(dim=1)
        take = (start < 0) & (latest >= 0) & (lengths > n)
        start = torch.where(take, latest + n, start)
    # Cut at the row's end: a continuation shorter than k repeats its own last token.
    offsets = torch.minimum(torch.arange(k)[None, :], (lengths - start - 1)[:, None])
    drafts = history.gather(1, (start[:, None] + offsets).clamp(min=0, max=width - 1))
    return torch.where(start[:, None] >= 0, drafts, last[:, None])


class NgramProposer:
    """The n-gram drafter (`Drafter`): each sequence's tokens, prompt and output, on the host, and its last
    proposal, whose accepted part the next verdict appends. Its drafts are deterministic, so q is one-hot (no
    probabilities are sent): lossless under the rejection sampler as any greedy draft."""

    def __init__(self, num_slots: int, max_len: int, min_n: int = 1, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"--ngram-min {min_n} and --ngram-max {max_n}: give 1 <= min <= max")
        self.num_slots, self.max_len, self.min_n, self.max_n = num_slots, max_len, min_n, max_n
        self.tokens: dict[int, list[int]] = {}  # sequence id -> its tokens, prompt and output
        self.last_drafts: dict[int, list[int]] = {}  # sequence id -> its last proposal (empty after a prefill)

    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> list[int]:
        held = [s for s in seq_ids if s in self.tokens]
        if held or len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest(f"sequence ids already held: {held or list(seq_ids)}")
        if len(self.tokens) + len(seq_ids) > self.num_slots:
            raise CapacityError(f"need {len(seq_ids)} sequence rows, {self.num_slots - len(self.tokens)} free")
        for seq_id, prompt in zip(seq_ids, prompts, strict=True):
            self.tokens[seq_id], self.last_drafts[seq_id] = list(prompt), []
        return [0] * len(seq_ids)

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
        check_proposal(seq_ids, self.tokens, k)
        histories = []
        for b, (seq_id, accepted, token) in enumerate(zip(seq_ids, num_accepted.tolist(), next_tokens.tolist())):
            tokens = self.tokens[seq_id]
            tokens += self.last_drafts[seq_id][:accepted]
            if missed:
                tokens += missed[b]
            tokens.append(token)
            histories.append(tokens)
        lengths = torch.tensor([len(t) for t in histories], dtype=torch.long)
        history = torch.zeros(len(histories), int(lengths.max()), dtype=torch.long)
        for b, tokens in enumerate(histories):
            history[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        drafts = ngram_lookup(history, lengths, k, self.min_n, self.max_n)
        for seq_id, row in zip(seq_ids, drafts.tolist()):
            self.last_drafts[seq_id] = row
        return Proposal(drafts, None)

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.tokens.pop(seq_id, None)
            self.last_drafts.pop(seq_id, None)

    def held_seq_ids(self) -> list[int]:
        return list(self.tokens)

    def precapture(self, k: int, max_batch: int) -> int:
        return 0  # nothing to capture: no model
