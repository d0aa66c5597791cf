"""Sampling math shared by drafter and verifier: per-row logits processing and counter-based seeded uniforms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

import torch

from minedraft.kernels import triton_runs


def _argmax_kernels() -> ModuleType | None:  # None without CUDA or Triton
    if not triton_runs():
        return None
    from minedraft.kernels import argmax

    return argmax


ARGMAX_KERNELS = _argmax_kernels()
# Uniform streams: each decision at a sequence position draws from its own stream, so a request's randomness
# depends only on (seed, position, purpose) and never on which other requests share its batch.
STREAM_ACCEPT = 0
STREAM_SAMPLE = 1
STREAM_DRAFT = 2

_MASK32 = 0xFFFFFFFF
MAX_STOP_TOKEN_IDS = 16


@dataclass(frozen=True)
class SamplingConfig:
    """One request's decoding parameters, as a worker receives them (already validated and defaulted)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SamplingKind(NamedTuple):
    """What a batch's sampling needs, known on the host (`SequenceTable.sampling_kind`): each kind its own code, and
    its own CUDA graphs."""

    all_greedy: bool  # every row greedy: no probabilities are made
    filtered: bool  # some row restricted by top-k or top-p

    @property
    def name(self) -> str:
        return "greedy" if self.all_greedy else "filtered" if self.filtered else "sampled"


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors; the multiplier stays under 2**31, so products fit int64."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def seed_key(seed: torch.Tensor) -> torch.Tensor:
    """Seeds [B] (int64 holding uint64's bits) folded into the 32-bit keys `seeded_uniform` draws from: once per
    sequence, where it is admitted, rather than in every draw (each mix is ten small kernels in a step's graph)."""
    seed = seed.to(torch.int64)
    return _mix32(_mix32(seed & _MASK32) ^ ((seed >> 32) & _MASK32))


def seeded_uniform(key: torch.Tensor, position: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1) as float64, a pure function of (seed, position [B, n], stream); `key` [B] is the seeds'
    `seed_key`."""
    key = _mix32(key[:, None] ^ (position.to(torch.int64) & _MASK32))
    high = _mix32(key ^ (2 * stream + 0x9E3779B1 & _MASK32)) >> 5  # 27 bits
    low = _mix32(key ^ (2 * stream + 0x7F4A7C15 & _MASK32)) >> 6  # 26 bits
    return (high * (1 << 26) + low).to(torch.float64) / float(1 << 53)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, the first of equal maxima included, in two passes over a large vocabulary.

    One argmax over a 128k vocabulary is a single block's reduction per row: 28 us on an H200 at batch 1, every
    draft step and every verify. The max of each chunk of the vocabulary, then the argmax over the chunks, spreads it
    over the GPU: on CUDA as two Triton kernels (`minedraft.kernels.argmax`: 10.5 us for 80 rows of 128k on an H200,
    where the chunks' max in PyTorch, compiled, took 41).
    """
    vocab = logits.shape[-1]
    if logits.is_cuda and ARGMAX_KERNELS is not None:
        return ARGMAX_KERNELS.chunked_argmax(logits)
    chunk = math.gcd(vocab, 1024)
    if chunk < 64 or vocab < 8 * chunk:
        return logits.argmax(-1)
    maxima, within = logits.unflatten(-1, (vocab // chunk, chunk)).max(dim=-1)  # the first index of a chunk's maximum
    best = maxima.argmax(dim=-1, keepdim=True)  # the first chunk holding the maximum
    return (best * chunk + within.gather(-1, best)).squeeze(-1)


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    filtered: bool,
) -> torch.Tensor:
    """Softmax of `logits` [B, n, V] after per-row temperature, then top-k, then top-p (Hugging Face's order).

    Rows with temperature 0 are processed at temperature 1; greedy callers use the argmax instead. `filtered`
    says whether any row has top-k or top-p, known on the host (`SequenceTable.sampling_kind`): finding it out from
    these tensors would be a device sync, which CUDA graphs cannot hold. Computed in float32 whatever the logits'
    type.
    """
    logits = logits.float()
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.dtype)
    logits = logits / temp[:, None, None]
    vocab = logits.shape[-1]
    k = top_k[:, None, None]
    p = top_p.to(logits.dtype)[:, None, None]
    if filtered:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill((k > 0) & (ranks >= k), float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Rows without top-p must keep every token: a float32 cumsum reaches 1.0 before the tail.
        sorted_logits = sorted_logits.masked_fill((p < 1) & (mass_above >= p), float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(dim=-1)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: `probs` [..., V] (need not be normalised), `uniform` [...] -> ids [...]."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    threshold = uniform * cdf[..., -1]
    ids = (cdf <= threshold[..., None]).sum(dim=-1)
    return ids.clamp_(max=probs.shape[-1] - 1)
