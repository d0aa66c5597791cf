"""N-gram prompt lookup: the batched lookup equals a plain one on random inputs; the drafter follows verdicts."""

from __future__ import annotations

import random

import torch

from draft_service.ngram import NgramProposer, ngram_lookup


def plain_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last n tokens occur earlier; the k tokens after the latest such
    occurrence, cut at the end (then its last token repeated); the last token k times without a match."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                return follow + [follow[-1]] * (k - len(follow))
    return [tokens[-1]] * k


def test_batched_lookup_equals_plain_lookup() -> None:
    rng = random.Random(0)
    for trial in range(200):
        batch, vocab = rng.randint(1, 6), rng.choice([2, 3, 5, 50])
        rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(batch)]
        k, min_n = rng.randint(1, 6), rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        lengths = torch.tensor([len(r) for r in rows])
        history = torch.full((batch, int(lengths.max())), 7)  # padding: an id that may also occur in rows
        for b, row in enumerate(rows):
            history[b, : len(row)] = torch.tensor(row)
        got = ngram_lookup(history, lengths, k, min_n, max_n).tolist()
        assert got == [plain_lookup(r, k, min_n, max_n) for r in rows], (trial, rows, k, min_n, max_n)


def test_proposer_appends_accepted_drafts_missed_and_emitted_tokens() -> None:
    proposer = NgramProposer(num_slots=4, max_len=64, min_n=1, max_n=3)
    proposer.prefill([1, 2], [[5, 6, 7, 8, 5, 6], [9]], [])
    first = proposer.propose([1, 2], torch.tensor([0, 0]), torch.tensor([7, 9]), k=3)
    assert first.draft_ids.tolist() == [[8, 5, 6], [9, 9, 9]] and first.draft_probs is None
    # Row 1 accepts 2 of [8, 5, 6] and the target emits 9; row 2 missed [3] before its next token 4.
    second = proposer.propose([1, 2], torch.tensor([2, 0]), torch.tensor([9, 4]), k=2, missed=[[], [3]])
    assert proposer.tokens[1] == [5, 6, 7, 8, 5, 6, 7, 8, 5, 9]
    assert proposer.tokens[2] == [9, 9, 3, 4]
    assert second.draft_ids.tolist() == [[9, 9], [4, 4]]
    proposer.release([1, 2])
    assert proposer.held_seq_ids() == []
