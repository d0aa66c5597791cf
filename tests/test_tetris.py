"""TETRIS's selection keeps the batch's most likely drafts; rows verifying a prefix of their drafts stay lossless."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from draft_service.tetris import select_draft_lengths
from minedraft.engine.sampling import greedy_tokens
from target_service.rejection_sampler import RowParams, rejection_sample


def reference_lengths(logprobs: list[list[float]], budget: int, live: list[bool]) -> list[int]:
    """Top-`budget` of the cumulative log-probabilities over the batch, counted per row, by sorting in Python."""
    scored = []
    for row, values in enumerate(logprobs):
        total = 0.0
        for value in values:
            total += value
            if live[row]:
                scored.append((total, row))
    scored.sort(reverse=True)
    counts = Counter(row for _, row in scored[:budget])
    return [counts[row] for row in range(len(logprobs))]


@pytest.mark.parametrize("seed", range(20))
def test_selection_equals_the_reference_top_of_cumulative_logprobs(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, width = int(torch.randint(1, 40, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    logprobs = torch.rand(batch, width, generator=gen).clamp_min(1e-6).log()
    live = torch.rand(batch, generator=gen) < 0.8
    budget = int(torch.randint(0, batch * width + 3, (1,), generator=gen))
    lengths = select_draft_lengths(logprobs, budget, live)
    expected = reference_lengths(logprobs.tolist(), budget, live.tolist())
    assert lengths.tolist() == expected
    assert int(lengths.sum()) == min(budget, int(live.sum()) * width)


def test_selection_prefers_rows_the_draft_is_sure_of() -> None:
    sure, unsure = math.log(0.95), math.log(0.3)
    logprobs = torch.tensor([[sure] * 6, [unsure] * 6, [sure, sure, unsure, unsure, unsure, unsure]])
    assert select_draft_lengths(logprobs, 8).tolist() == [6, 0, 2]  # 0.95^6 = 0.74 > 0.3 > 0.95^2 * 0.3


def params(batch: int, temperature: float) -> RowParams:
    return RowParams(
        temperature=torch.full((batch,), temperature),
        top_k=torch.zeros(batch, dtype=torch.long),
        top_p=torch.ones(batch),
        seed_key=torch.arange(batch, dtype=torch.long) * 7919 + 3,
    )


def test_greedy_rows_accept_no_draft_past_their_length() -> None:
    gen = torch.Generator().manual_seed(0)
    batch, k, vocab = 6, 4, 11
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    drafts = greedy_tokens(logits)[:, :k]  # every draft is the target's choice: all would be accepted
    lengths = torch.tensor([0, 1, 2, 3, 4, 2])
    out = rejection_sample(
        logits, drafts, None, params(batch, 0.0), torch.full((batch,), 9), None,
        all_greedy=True, filtered=False, draft_lengths=lengths,
    )  # fmt: skip
    assert out.num_accepted.tolist() == lengths.tolist()
    rows = torch.arange(batch)
    assert torch.equal(out.tokens[rows, lengths], greedy_tokens(logits)[rows, lengths])


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    """Pearson's test of `samples` against `probs` (cells below 5 expected pooled), by a normal approximation of
    the chi-square law's tail (Wilson-Hilferty), enough for a pass/fail at 1e-4."""
    n, counts = len(samples), Counter(samples)
    statistic, cells = 0.0, 0
    for token, p in enumerate(probs.tolist()):
        expected = p * n
        if expected >= 5:
            statistic += (counts[token] - expected) ** 2 / expected
            cells += 1
    df = cells - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("length", [0, 1, 2])
def test_a_verified_prefix_keeps_the_target_distribution(length: int) -> None:
    """Sampled rows with draft length 0, 1 or 2 of k = 2 drafts: the first token has the target's p0, and after
    an accepted first draft the second has p1 (at length 1 drawn from p1 itself, not from a residual against q1)."""
    gen = torch.Generator().manual_seed(length)
    batch, k, vocab = 60_000, 2, 6
    logits = (torch.randn(1, k + 1, vocab, generator=gen) * 1.5).expand(batch, -1, -1).contiguous()
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(q[j], batch, replacement=True, generator=gen) for j in range(k)], dim=1)
    out = rejection_sample(
        logits, drafts, q.expand(batch, -1, -1).contiguous(), params(batch, 1.0), torch.full((batch,), 5), None,
        all_greedy=False, filtered=False, draft_lengths=torch.full((batch,), length),
    )  # fmt: skip
    p = torch.softmax(logits[0], dim=-1)
    assert int(out.num_accepted.max()) <= length
    assert chi_square_p(out.tokens[:, 0].tolist(), p[0]) > 1e-4
    if length:
        second = out.tokens[out.num_accepted >= 1, 1].tolist()
        assert chi_square_p(second, p[1]) > 1e-4
