"""Sampling math shared by drafter and verifier: per-row logits processing and counter-based seeded uniforms."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

import torch

from minedraft.kernels import triton_runs
from minedraft.proto import generation_pb2


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
STREAM_SYNTHETIC_RATE = 3

_MASK32 = 0xFFFFFFFF
MAX_STOP_TOKEN_IDS = 16
MAX_LOGIT_BIAS = 300  # token ids a request may bias (OpenAI's limit): a row of the sequence table holds as many
MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for: a step computes this many for every row


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
    logprobs: int | None = None  # top log-probabilities reported per token (0: the chosen one's only); None: none
    min_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_tokens: int = 0  # of the prompt a worker is given, the last tokens that are output (after a preemption)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), by id
    prompt_logprobs: int | None = None  # the prompt's log-probabilities, top ones per token as `logprobs`; None: none
    # Structured output: (kind, source, compact JSON), `minedraft.engine.grammar.KINDS`
    grammar: tuple[str, str, bool] | None = None

    @classmethod
    def from_proto(
        cls, params: generation_pb2.SamplingParams, *, max_tokens: int = 0, seed: int = 0, output_tokens: int = 0
    ) -> SamplingConfig:
        """The config `params` give, unchecked; `max_tokens` and `seed` where they leave those unset (a worker is
        always sent both), the other optional fields' defaults here. Stop strings are the coordinator's alone."""
        return cls(
            temperature=params.temperature,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
            top_k=params.top_k,
            seed=params.seed if params.HasField("seed") else seed,
            max_tokens=params.max_tokens if params.HasField("max_tokens") else max_tokens,
            stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            logprobs=params.logprobs if params.HasField("logprobs") else None,
            min_tokens=params.min_tokens,
            min_p=params.min_p,
            repetition_penalty=params.repetition_penalty if params.HasField("repetition_penalty") else 1.0,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            output_tokens=output_tokens,
            logit_bias=tuple(sorted(params.logit_bias.items())),
            prompt_logprobs=params.prompt_logprobs if params.HasField("prompt_logprobs") else None,
            grammar=_grammar_of(params.structured_output) if params.HasField("structured_output") else None,
        )

    def to_proto(self) -> generation_pb2.SamplingParams:
        """The parameters as a worker is sent them: every field set but stop (logprobs, prompt_logprobs where not None);
        output_tokens goes in the SequenceSpec."""
        return generation_pb2.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=self.logprobs,
            min_tokens=self.min_tokens,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(self.logit_bias),
            prompt_logprobs=self.prompt_logprobs,
            structured_output=None if self.grammar is None else _structured_output(*self.grammar),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the logits are changed before sampling: by the sequence's history (penalties, min_tokens) or a
        logit bias."""
        return (
            bool(self.logit_bias)
            or self.min_tokens > 0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def _grammar_of(output: generation_pb2.StructuredOutput) -> tuple[str, str, bool] | None:
    """SamplingConfig.grammar of a StructuredOutput: a choice's strings as a JSON list, json_object's as nothing."""
    kind = output.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not output.json_object):
        return None
    if kind == "choice":
        return kind, json.dumps(list(output.choice.choices)), output.disable_any_whitespace
    return kind, "" if kind == "json_object" else getattr(output, kind), output.disable_any_whitespace


def _structured_output(kind: str, source: str, compact: bool) -> generation_pb2.StructuredOutput:
    output = generation_pb2.StructuredOutput(disable_any_whitespace=compact)
    if kind == "choice":
        output.choice.choices.extend(json.loads(source))
    elif kind == "json_object":
        output.json_object = True
    else:
        setattr(output, kind, source)  # (json_schema, regex or grammar: a string)
    return output


class SamplingKind(NamedTuple):
    """What a batch's sampling needs, known on the host (`SequenceTable.sampling_kind`): each kind its own code, and
    its own CUDA graphs."""

    all_greedy: bool  # every row greedy: no probabilities are made
    filtered: bool  # some row restricted by top-k, top-p or min-p
    penalized: bool = False  # some row has penalties or min_tokens: its logits depend on its history
    logprobs: bool = False  # some row reports log-probabilities (the target's steps only)
    grammar: bool = False  # some row's output is constrained by a grammar (the target masks its logits)

    @property
    def name(self) -> str:
        base = "greedy" if self.all_greedy else "filtered" if self.filtered else "sampled"
        extras = ("-penalized", self.penalized), ("-logprobs", self.logprobs), ("-grammar", self.grammar)
        return base + "".join(suffix for suffix, on in extras if on)


@dataclass
class Penalties:
    """Per-row penalty parameters of one step, gathered from the sequence table (`SequenceTable.penalties`)."""

    repetition: torch.Tensor  # [B] float, 1 = off
    presence: torch.Tensor  # [B] float
    frequency: torch.Tensor  # [B] float
    min_tokens: torch.Tensor  # [B] long
    output_start: torch.Tensor  # [B] long: the sequence index of the first output token
    stop_ids: torch.Tensor  # [B, S] long: what min_tokens masks (EOS unless ignored, stop ids), -1 = none
    bias_ids: torch.Tensor | None = None  # [B, MAX_LOGIT_BIAS] long: the token ids a row biases, -1 = none
    bias: torch.Tensor | None = None  # [B, MAX_LOGIT_BIAS] float: what each adds to its logit


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


def synthetic_row_rates(
    rates: torch.Tensor, seed_key: torch.Tensor, first_position: torch.Tensor | None
) -> torch.Tensor:
    """Benchmarks only (--synthetic-row-acceptance): each row's acceptance rate [B] of `rates`, picked by its seed
    for all its steps, or with `first_position` [B] (--synthetic-rate-by step: its step's first draft position)
    drawn anew each step, so that easy and hard rows stay mixed in every batch. The target and the draft compute
    the same from the same (seed, position)."""
    if first_position is None:
        return rates[seed_key % len(rates)]
    draw = seeded_uniform(seed_key, first_position[:, None], STREAM_SYNTHETIC_RATE)[:, 0]
    return rates[(draw * len(rates)).long().clamp(max=len(rates) - 1)]


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


def penalized_logits(
    logits: torch.Tensor, history: torch.Tensor, length: torch.Tensor, upcoming: torch.Tensor, pen: Penalties
) -> torch.Tensor:
    """`logits` [B, n, V] (float32) after min_tokens and the penalties, position j's seeing the row's `history`
    [B, H] up to `length` [B] and then `upcoming[:, :j]` [B, n - 1] (the drafts a verify scores, in order).

    A logit bias first (as vLLM applies it), then repetition penalty as Hugging Face's (prompt and output tokens),
    presence and frequency as OpenAI's and vLLM's (output tokens only); min_tokens masks the stop tokens while fewer
    than min_tokens tokens precede the position.
    """
    logits = logits.float()
    batch, n, vocab = logits.shape
    if pen.bias_ids is not None and pen.bias is not None:  # (a column past the vocabulary takes the unused slots)
        ids = torch.where(pen.bias_ids >= 0, pen.bias_ids, vocab).clamp(max=vocab)
        bias = logits.new_zeros(batch, vocab + 1).scatter_add_(1, ids, pen.bias.float())[:, :vocab]
        logits = logits + bias[:, None, :]
    index = torch.arange(history.shape[1], device=logits.device)[None, :]
    valid = index < length[:, None]
    ids = history.to(torch.long).clamp(0, vocab - 1)
    counts = logits.new_zeros(batch, vocab).scatter_add_(1, ids, (valid & (index >= pen.output_start[:, None])).float())
    seen = logits.new_zeros(batch, vocab).scatter_add_(1, ids, valid.float())
    # The drafts before each position, as counts: every draft is output.
    ahead = logits.new_zeros(batch, n, vocab)
    if n > 1:
        ahead[:, 1:].scatter_(2, upcoming[:, : n - 1, None].clamp(0, vocab - 1), 1.0)
        ahead = ahead.cumsum(dim=1)
    counts, seen = counts[:, None] + ahead, seen[:, None] + ahead
    rep = pen.repetition[:, None, None]
    logits = torch.where(seen > 0, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - pen.presence[:, None, None] * (counts > 0) - pen.frequency[:, None, None] * counts
    generated = length[:, None] - pen.output_start[:, None] + torch.arange(n, device=logits.device)
    stops = torch.where(pen.stop_ids >= 0, pen.stop_ids, vocab).clamp(max=vocab)  # (vocab: a column dropped after)
    is_stop = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(1, stops, True)
    masked = is_stop[:, None, :vocab] & (generated < pen.min_tokens[:, None])[..., None]
    return logits.masked_fill(masked, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a step reports of `tokens` [B, n] under `logits` [B, n, V] (penalized already): each token's
    log-probability [B, n] and the MAX_LOGPROBS most likely tokens' [B, n, N], with their ids, from log_softmax
    after the temperature (0 taken as 1), before top-k, top-p and min-p."""
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    logprobs = (logits.float() / temp[:, None, None]).log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[..., None]).squeeze(-1)
    top = logprobs.topk(min(MAX_LOGPROBS, logprobs.shape[-1]), dim=-1)
    return chosen, top.values, top.indices


def processed_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    filtered: bool,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax of `logits` [B, n, V] after per-row temperature, then top-k, then top-p, then min-p (Hugging Face's
    order).

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
        if min_p is not None:  # p < min_p * p_max, as logits: below the maximum by more than -log(min_p)
            floor = logits.amax(dim=-1, keepdim=True) + min_p.to(logits.dtype).log()[:, None, None]
            logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits.softmax(dim=-1)


def sample_from(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: `probs` [..., V] (need not be normalised), `uniform` [...] -> ids [...]."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    threshold = uniform * cdf[..., -1]
    ids = (cdf <= threshold[..., None]).sum(dim=-1)
    return ids.clamp_(max=probs.shape[-1] - 1)
