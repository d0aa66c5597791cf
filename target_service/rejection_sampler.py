"""Batched lossless speculative sampling (Leviathan et al. 2023): greedy and sampled rows in one batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minedraft.engine.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    greedy_tokens,
    processed_probs,
    sample_from,
    seeded_uniform,
)


@dataclass
class RowParams:
    """Per-row sampling parameters of one verify batch, gathered from the sequence table."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor  # [B] long, 0 = off
    top_p: torch.Tensor  # [B] float
    seed_key: torch.Tensor  # [B] long: sampling.seed_key of each row's seed
    min_p: torch.Tensor | None = None  # [B] float, 0 = off


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [B, k + 1]: accepted drafts, then the correction or bonus token, then filler
    num_accepted: torch.Tensor  # [B]: drafts accepted; each row emits num_accepted + 1 tokens


def rejection_sample(
    target_logits: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    params: RowParams,
    first_position: torch.Tensor,
    synthetic_acceptance: float | torch.Tensor | None,
    *,
    all_greedy: bool,
    filtered: bool,
    draft_lengths: torch.Tensor | None = None,
    target_argmax: torch.Tensor | None = None,
) -> SamplerOutput:
    """Decide every row's drafts against the target in one pass.

    target_logits [B, k+1, V] scores each draft position and the bonus position; draft_ids [B, k]; draft_probs
    [B, k, V'] (V' <= V) are the draft's processed probabilities, or None for greedy drafts (a one-hot q).
    first_position [B] is the sequence index of the first draft token, which keys the row's seeded uniforms.

    `synthetic_acceptance` (benchmarks only, NOT lossless) accepts each draft with that probability whatever the
    models say, so throughput can be measured at a realistic acceptance with random weights (as vLLM's synthetic
    rejection mode); a [B, 1] tensor gives each row its own rate. `all_greedy` and `filtered` (some row has top-k
    or top-p) come from the host (the sequence table), so no device sync finds them out.

    `draft_lengths` [B] (None: every row k) verifies only a prefix of each row's drafts, as TETRIS selects them
    (design section 14): drafts past a row's length are never accepted, and the token after a full accept of that
    prefix comes from p, as after k accepts; so a row's verified prefix is an ordinary shorter draft, lossless.

    `target_argmax` [B, k+1]: the logits' argmax, found by the caller (a ragged verify, over its flattened tokens),
    where `all_greedy` (or synthetic acceptance) reads nothing else of `target_logits`.
    """
    batch, k = draft_ids.shape
    rows = torch.arange(batch, device=draft_ids.device)
    if target_argmax is None:
        target_argmax = greedy_tokens(target_logits)  # [B, k+1]
    else:
        assert all_greedy or synthetic_acceptance is not None, "sampling reads more than the argmax"
    accept = draft_ids == target_argmax[:, :k]
    within = None if draft_lengths is None else torch.arange(k, device=draft_ids.device) < draft_lengths[:, None]
    if within is not None:
        accept &= within
    if synthetic_acceptance is not None:
        positions = first_position[:, None] + torch.arange(k, device=draft_ids.device)
        accept = seeded_uniform(params.seed_key, positions, STREAM_ACCEPT) < synthetic_acceptance
        if within is not None:
            accept &= within
        num_accepted = _accepted_prefix(accept)
        return _emit(draft_ids, num_accepted, target_argmax[rows, num_accepted])
    if all_greedy:  # the common serving case: no probabilities needed at all
        num_accepted = _accepted_prefix(accept)
        return _emit(draft_ids, num_accepted, target_argmax[rows, num_accepted])

    vocab = target_logits.shape[-1]
    positions = first_position[:, None] + torch.arange(k + 1, device=draft_ids.device)
    p = processed_probs(target_logits, params.temperature, params.top_k, params.top_p, filtered, params.min_p)
    if draft_probs is None:
        q = torch.zeros_like(p[:, :k]).scatter_(-1, draft_ids[..., None], 1.0)  # one-hot, without F.one_hot's sync
    else:
        q = draft_probs.to(p.dtype)
        if q.shape[-1] < vocab:  # (the verifier pads them already: a pad of nothing would still copy)
            q = torch.nn.functional.pad(q, (0, vocab - q.shape[-1]))
    if within is not None:  # no q past a row's prefix: the token after it is drawn from p itself
        q = q * within[..., None]
    p_draft = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1).to(torch.float64)
    q_draft = q.gather(-1, draft_ids[..., None]).squeeze(-1).to(torch.float64)
    u_accept = seeded_uniform(params.seed_key, positions[:, :k], STREAM_ACCEPT)
    greedy = params.temperature == 0
    # Accept with probability min(1, p/q), written without a division: u * q < p.
    accept = torch.where(greedy[:, None], accept, u_accept * q_draft < p_draft)
    if within is not None:
        accept &= within
    num_accepted = _accepted_prefix(accept)

    # The token after the accepted prefix: from norm(max(p - q, 0)) at a rejection, from p after k accepts.
    p_next = p[rows, num_accepted]  # [B, V]
    q_next = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)[rows, num_accepted]
    residual = (p_next - q_next).clamp_(min=0)
    # p == q leaves no residual mass, and a rejection then has probability 0; fall back to p for safety.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    u_sample = seeded_uniform(params.seed_key, positions[rows, num_accepted][:, None], STREAM_SAMPLE)[:, 0]
    next_token = torch.where(greedy, target_argmax[rows, num_accepted], sample_from(residual, u_sample))
    return _emit(draft_ids, num_accepted, next_token)


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Length of each row's leading run of accepted drafts."""
    return accept.to(torch.long).cumprod(dim=-1).sum(dim=-1)


def _emit(draft_ids: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> SamplerOutput:
    tokens = torch.cat([draft_ids, draft_ids.new_zeros(len(draft_ids), 1)], dim=1)
    tokens[torch.arange(len(tokens), device=tokens.device), num_accepted] = next_token
    return SamplerOutput(tokens=tokens, num_accepted=num_accepted)
