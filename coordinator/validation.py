"""Checks of a GenerateRequest before it is admitted: each ValueError's message reaches its client as it is."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

from minedraft.engine.sampling import MAX_STOP_TOKEN_IDS, SamplingConfig
from minedraft.proto import generation_pb2

DEFAULT_MAX_TOKENS = 16


def prompt_token_ids(request: generation_pb2.GenerateRequest, tokenizer: object | None, vocab_size: int) -> list[int]:
    """The request's prompt as token ids: given as such, or its text tokenized; never empty, all in the vocabulary."""
    if request.prompt and request.prompt_token_ids:
        raise ValueError("give either prompt or prompt_token_ids, not both")
    if request.prompt_token_ids:
        prompt_ids = list(request.prompt_token_ids)
    elif request.prompt:
        if tokenizer is None:
            raise ValueError("this server has no tokenizer: send prompt_token_ids")
        prompt_ids = tokenizer.encode(request.prompt)  # type: ignore[attr-defined]
    else:
        prompt_ids = []
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    _check_in_vocabulary("prompt token ids", prompt_ids, vocab_size)
    return prompt_ids


def sampling_config(
    params: generation_pb2.SamplingParams, prompt_length: int, vocab_size: int, context: int
) -> SamplingConfig:
    """The request's sampling, checked and defaulted (a random seed where it gives none). `context`: the tokens a
    sequence may hold, prompt and output."""
    max_tokens = params.max_tokens or DEFAULT_MAX_TOKENS
    _check_length(prompt_length, max_tokens, context)
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {params.temperature}")
    if not (0 <= params.top_p <= 1) or math.isnan(params.top_p):
        raise ValueError(f"top_p must be in (0, 1] (0 means unset, i.e. 1), got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {params.top_k}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(params.stop_token_ids)}")
    _check_in_vocabulary("stop_token_ids", params.stop_token_ids, vocab_size)
    return SamplingConfig(
        temperature=float(params.temperature),
        top_p=float(params.top_p) or 1.0,
        top_k=int(params.top_k),
        seed=params.seed if params.HasField("seed") else secrets.randbits(63),
        max_tokens=max_tokens,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def _check_length(prompt_length: int, max_tokens: int, context: int) -> None:
    if prompt_length >= context:
        raise ValueError(f"the prompt has {prompt_length} tokens; this server's context is {context} tokens")
    if prompt_length + max_tokens > context:
        raise ValueError(
            f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) = {prompt_length + max_tokens} "
            f"exceeds the context length of {context} tokens; lower max_tokens to {context - prompt_length}"
        )


def _check_in_vocabulary(what: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
