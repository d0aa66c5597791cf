"""TETRIS selection (design section 14): which prefix of each row's drafts a fixed verify budget verifies."""

from __future__ import annotations

import torch


def select_draft_lengths(
    draft_logprobs: torch.Tensor, budget: int, rows_live: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row's verified draft length: the `budget` drafts of the batch most likely to be accepted.

    A draft's score is its row's cumulative draft log-probability up to it (the chance, by the draft, that the
    whole prefix is accepted); the top `budget` scores over the batch are kept. Scores never rise along a row, so
    the kept drafts of a row are a prefix of it, and a row's length is how many it kept (ties keep the count).
    draft_logprobs [B, K]: log q of each drafted token; rows_live [B] bool (None: all) marks rows that verify at
    all. Runs on the device without a host sync.
    """
    batch, width = draft_logprobs.shape
    scores = draft_logprobs.to(torch.float32).cumsum(dim=-1)
    if rows_live is not None:
        scores = scores.masked_fill(~rows_live[:, None], float("-inf"))
    kept = torch.zeros(batch * width, dtype=torch.bool, device=draft_logprobs.device)
    kept[scores.flatten().topk(min(budget, batch * width)).indices] = True
    kept = kept.view(batch, width) & scores.isfinite()
    return kept.sum(dim=-1)


# A drafter without probabilities (n-gram): every draft the same chance, so a row's score falls with each token and
# the budget is shared out evenly, each row a prefix of its drafts.
UNIFORM_LOGPROB = -0.6931471805599453  # log(1/2)


def draft_logprobs(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, token_logprobs: torch.Tensor | None
) -> torch.Tensor:
    """Each drafted token's log q [B, K]: the drafter's own scores where it made them (`Proposal.token_logprobs`),
    else read from its distributions, else uniform (`UNIFORM_LOGPROB`)."""
    if token_logprobs is not None:
        return token_logprobs.to(torch.float32)
    if draft_probs is not None:
        chosen = draft_probs.gather(-1, draft_ids[..., None].to(torch.long))[..., 0].to(torch.float32)
        return chosen.clamp(min=torch.finfo(torch.float32).tiny).log()
    return torch.full(draft_ids.shape, UNIFORM_LOGPROB, dtype=torch.float32, device=draft_ids.device)


def selected_drafts(draft_ids: torch.Tensor, logprobs: torch.Tensor, budget: int) -> torch.Tensor:
    """The drafts with -1 past each row's selected length (`select_draft_lengths`), as they travel to the target
    (DraftPayload.selected); on the device, no host sync."""
    lengths = select_draft_lengths(logprobs, budget)
    past = torch.arange(draft_ids.shape[1], device=draft_ids.device) >= lengths[:, None]
    return draft_ids.masked_fill(past, -1)
