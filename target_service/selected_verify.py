"""TETRIS's verify of selected drafts (design section 14): counts, the cut to a prepared width, ragged tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minedraft.engine import cuda_graphs
from minedraft.engine.sampling import greedy_tokens


def selected_shape(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    selected: bool,
    widths: Sequence[int],
    ragged: bool,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor | None, int | None, int | None]:
    """A verify's drafts (and probabilities), where `ragged` the flattened tokens its forward runs, and where every
    row keeps all of its cut drafts their common count (the verify is then plain SD's, a row no shorter than the
    width: no layout, no lengths). With `selected`, cut to the fewest of `widths` that holds the longest row
    (`cut_to_width`), the tokens each row's pending one and its drafts, on CUDA rounded up to a graph's bucket
    (`cuda_graphs.ragged_tokens`). A host sync where the drafts came on the device (a few ints); none where there
    is neither a cut nor a layout to make."""
    if not selected or not (widths or ragged):
        return draft_ids, draft_probs, None, None
    counts = (draft_ids >= 0).sum(dim=1).tolist()
    draft_ids, draft_probs = cut_to_width(draft_ids, draft_probs, max(counts, default=0), widths)
    if counts and min(counts) == max(counts) == draft_ids.shape[1]:
        return draft_ids, draft_probs, None, counts[0]
    rows = len(counts)
    flattened = cuda_graphs.ragged_tokens(rows, sum(counts) + rows, device.type == "cuda") if ragged else None
    return draft_ids, draft_probs, flattened, None


def selected_drafts(
    drafts: torch.Tensor, rows: torch.Tensor, num_valid: torch.Tensor, fill_row: int, selected: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Inside a verify's graph: (the drafts to run, each row's verified draft count where `selected` (TETRIS: up to
    its first id of -1; None: all), the tokens a ragged forward runs per row: the pending one and those drafts, none
    on the padding rows of `fill_row`). -1 ids are never accepted; any real id runs in their place."""
    if not selected:
        return drafts, None, num_valid
    lengths = (drafts >= 0).sum(dim=-1)
    return drafts.clamp(min=0), lengths, torch.where(rows == fill_row, 0, lengths + 1)


def flat_argmax(logits: torch.Tensor, unflatten: torch.Tensor | None) -> torch.Tensor:
    """A ragged greedy verify's argmax `[B, n]`: over its flattened tokens' logits `[T, V]`, then laid out in its
    rows by `unflatten` (`ForwardPass.step_forward`): T rows read, not B x n."""
    assert unflatten is not None
    return greedy_tokens(logits)[unflatten]


def cut_to_width(
    draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, longest: int, widths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Selected drafts (-1 past each row's) cut to the fewest of `widths` (the draft counts prepared) that holds the
    `longest` row: columns of -1 in every row would only widen the step (attention's queries a row, the acceptance's
    inputs), never change what it accepts. Unchanged when no prepared width is narrower."""
    width = min((w for w in widths if w >= max(longest, 1)), default=draft_ids.shape[1])
    if width >= draft_ids.shape[1]:
        return draft_ids, draft_probs
    return draft_ids[:, :width], None if draft_probs is None else draft_probs[:, :width]


def verify_variants(drafts: int, selected: bool, ragged: bool, device: torch.device) -> list[tuple[bool, int]]:
    """The verifies of `drafts` drafts that `Verifier.precapture` runs, as (selected, tokens a row; 0: padded):
    the plain one; with `selected` (TETRIS) the verify of selected drafts, `ragged` at each of 1..drafts + 1 tokens
    a row on CUDA (`cuda_graphs.ragged_tokens`) and elsewhere, where a ragged verify runs its exact total, the
    widest only."""
    variants = [(False, 0)]
    if drafts and selected and not ragged:
        variants.append((True, 0))
    elif drafts and selected:
        variants += [(True, width) for width in (range(1, drafts + 2) if device.type == "cuda" else [drafts + 1])]
    return variants
