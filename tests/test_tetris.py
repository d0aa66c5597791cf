"""TETRIS's selection keeps the batch's most likely drafts; rows verifying a prefix of their drafts stay lossless."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from coordinator.tetris_policy import (
    AUTO_CHOICES,
    ExtraProposals,
    hidden_extra,
    parse_extra_proposals,
    prepared_lengths,
)
from draft_service.proposer import synthetic_scores
from draft_service.tetris import UNIFORM_LOGPROB, draft_logprobs, select_draft_lengths, selected_drafts
from minedraft.engine.sampling import greedy_tokens, synthetic_row_rates
from target_service.rejection_sampler import RowParams, rejection_sample
from target_service.selected_verify import cut_to_width


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


def test_selected_drafts_end_each_row_at_its_length_with_minus_one() -> None:
    ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
    logprobs = torch.tensor([[-0.1, -0.1, -0.1], [-3.0, -0.1, -0.1], [-0.5, -2.0, -0.1]])
    # cumulative: row 0 -0.1 -0.2 -0.3; row 1 -3 ...; row 2 -0.5 -2.5: the top 4 are row 0's three and row 2's first
    assert selected_drafts(ids, logprobs, 4).tolist() == [[5, 6, 7], [-1, -1, -1], [11, -1, -1]]


def test_a_drafter_without_probabilities_shares_the_budget_out_evenly_as_prefixes() -> None:
    ids = torch.arange(12).view(4, 3)
    scores = draft_logprobs(ids, None, None)
    assert torch.equal(scores, torch.full((4, 3), UNIFORM_LOGPROB))
    assert select_draft_lengths(scores, 8).tolist() == [2, 2, 2, 2]
    assert select_draft_lengths(scores, 6).sum() == 6 and select_draft_lengths(scores, 6).max() == 2


def test_draft_logprobs_read_the_drafts_own_probabilities() -> None:
    ids = torch.tensor([[1, 0]])
    probs = torch.tensor([[[0.2, 0.8, 0.0], [0.5, 0.25, 0.25]]])
    assert torch.allclose(draft_logprobs(ids, probs, None), torch.tensor([[0.8, 0.5]]).log())
    given = torch.tensor([[-1.0, -2.0]])
    assert torch.equal(draft_logprobs(ids, probs, given), given)  # the drafter's own scores first


def test_extra_proposals_parse_a_count_or_auto_and_refuse_the_rest() -> None:
    assert parse_extra_proposals("4") == 4 and parse_extra_proposals("0") == 0
    assert parse_extra_proposals("auto") is None
    for bad in ("-1", "two", ""):
        with pytest.raises(ValueError, match="give a count of 0 or more, or auto"):
            parse_extra_proposals(bad)


def test_hidden_extra_is_the_most_the_verify_hides() -> None:
    # A draft token costs 1 ms: with k = 4, 6 ms of verify hides 2 extra, 8 ms hides 4, 4.5 ms none.
    assert hidden_extra(0.001, 0.006, 4, AUTO_CHOICES) == 2
    assert hidden_extra(0.001, 0.008, 4, AUTO_CHOICES) == 4
    assert hidden_extra(0.001, 0.0045, 4, AUTO_CHOICES) == 0
    assert hidden_extra(0.002, 0.001, 4, AUTO_CHOICES) == 0  # the draft is slower already: none


def test_auto_extra_proposals_follow_the_measured_step_times() -> None:
    fixed = ExtraProposals("3")
    fixed.record_propose(1.0, 4)
    assert fixed.choose(4) == 3 and fixed.choices == (3,)
    auto = ExtraProposals("auto")
    assert auto.choose(4) == max(AUTO_CHOICES)  # unmeasured: the most
    for _ in range(30):  # 1 ms a drafted token, a 6.5 ms verify
        auto.record_propose(0.008, 8)
        auto.record_verify(0.0065)
    assert auto.choose(4) == 2
    for _ in range(30):  # the verify got slower (a larger batch): more is hidden
        auto.record_verify(0.02)
    assert auto.choose(4) == 4
    for _ in range(30):  # the draft got slower than the verify: no extras
        auto.record_propose(0.08, 8)
    assert auto.choose(4) == 0


def test_auto_extra_proposals_take_none_where_no_verify_hides_them() -> None:
    """sd, or psd as one batch on a shared GPU: each extra draft adds its time to the step, so auto drafts none."""
    auto = ExtraProposals("auto")
    for _ in range(30):  # a verify that would hide 4 extra drafts beside it
        auto.record_propose(0.008, 8)
        auto.record_verify(0.02)
    assert auto.choose(4, hidden=True) == 4
    assert auto.choose(4, hidden=False) == 0
    assert ExtraProposals("2").choose(4, hidden=False) == 2  # a count given is kept


def test_prepared_lengths_hold_each_draft_length_alone_too() -> None:
    """With TETRIS both workers prepare each draft length with its extras and alone: a verify whose selected drafts
    fit the plain length is cut to it (`verifier.cut_to_width`), a shape prepared too."""
    assert prepared_lengths((4,), None) == (4,)
    assert prepared_lengths((4,), ExtraProposals("2")) == (6, 4)
    assert prepared_lengths((4, 2), ExtraProposals("auto")) == (8, 6, 4, 2)


def test_selected_drafts_are_cut_to_the_fewest_prepared_width_that_holds_them() -> None:
    drafts = torch.tensor([[5, 6, -1, -1, -1, -1], [7, -1, -1, -1, -1, -1]])
    probs = torch.rand(2, 6, 11)
    cut, cut_probs = cut_to_width(drafts, probs, 2, (4, 6))
    assert cut.tolist() == [[5, 6, -1, -1], [7, -1, -1, -1]] and cut_probs is not None and cut_probs.shape == (2, 4, 11)
    assert cut_to_width(drafts, None, 5, (4, 6))[0].shape == (2, 6)  # (none narrower holds 5)
    assert cut_to_width(drafts, None, 0, (4, 6))[0].shape == (2, 4)  # (no drafts at all: the narrowest)
    assert cut_to_width(drafts, None, 2, ())[0].shape == (2, 6)  # (nothing prepared: unchanged)


def test_synthetic_rates_by_step_are_drawn_anew_at_each_position_and_the_draft_scores_them_alike() -> None:
    rates = torch.tensor([0.9, 0.3])
    seeds = torch.arange(64) * 7919
    positions = torch.arange(64) + 100
    by_request = synthetic_row_rates(rates, seeds, None)
    assert torch.equal(by_request, rates[seeds % 2])
    by_step = synthetic_row_rates(rates, seeds, positions)
    assert torch.equal(by_step, synthetic_row_rates(rates, seeds, positions.clone()))  # a pure function
    one_row = synthetic_row_rates(rates, seeds[:1].expand(1000), torch.arange(1000))
    assert 400 < int((one_row == 0.9).sum()) < 600  # one request is easy at some steps, hard at others
    scores = synthetic_scores(rates, seeds, 3, positions)
    assert torch.equal(scores, by_step.log()[:, None].expand(64, 3))
