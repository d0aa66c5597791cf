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
