"""Checks of a GenerateRequest before it is admitted: each InvalidRequest's message reaches its client as it is."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from minedraft.engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS, SamplingConfig
from minedraft.errors import InvalidRequest as InvalidRequest  # (samples.py imports it from here)
from minedraft.proto import generation_pb2

DEFAULT_MAX_TOKENS = 16
PROMPT_INPUTS = ("prompt", "prompt_token_ids", "messages")  # a request gives exactly one


@dataclass(frozen=True)
class Limits:
    """What one request may hold, checked by `check_limits` before any work on it (each names its flag)."""

    max_prompt_bytes: int = 1 << 20
    max_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256


def check_limits(request: generation_pb2.GenerateRequest, limits: Limits) -> None:
    """Refuse a request over a limit before it is tokenized: sizes only, each counted in one pass."""
    if request.prompt:
        _check_size("the prompt", len(request.prompt.encode()), limits.max_prompt_bytes, "prompt")
    if request.messages:
        if len(request.messages) > limits.max_messages:
            raise InvalidRequest(
                f"{len(request.messages)} messages; this server takes at most {limits.max_messages} (--max-messages)",
                "messages",
            )
        size = sum(len(m.role.encode()) + len(m.content.encode()) for m in request.messages)
        _check_size("the messages", size, limits.max_prompt_bytes, "messages")
    stop = request.params.stop
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(
            f"{len(stop)} stop strings; this server takes at most {limits.max_stop_strings} (--max-stop-strings)",
            "stop",
        )
    longest = max((len(s.encode()) for s in stop), default=0)
    if longest > limits.max_stop_string_bytes:
        raise InvalidRequest(
            f"a stop string of {longest} bytes; this server takes at most {limits.max_stop_string_bytes} "
            "(--max-stop-string-bytes)",
            "stop",
        )


def _check_size(what: str, size: int, limit: int, param: str) -> None:
    if size > limit:
        raise InvalidRequest(f"{what} is {size} bytes; this server takes at most {limit} (--max-prompt-bytes)", param)


def prompt_token_ids(request: generation_pb2.GenerateRequest, tokenizer: object | None, vocab_size: int) -> list[int]:
    """The request's prompt as token ids: given as such, its text tokenized, or its messages rendered with the chat
    template; never empty, all in the vocabulary."""
    given = [name for name in PROMPT_INPUTS if getattr(request, name)]
    if len(given) > 1:
        which = f"not both {given[0]} and {given[1]}" if len(given) == 2 else "not all three"
        raise InvalidRequest(f"give only one of prompt, prompt_token_ids and messages, {which}", given[-1])
    if request.prompt_token_ids:
        prompt_ids = list(request.prompt_token_ids)
    elif request.prompt:
        prompt_ids = _tokenizer(tokenizer, "prompt").encode(request.prompt)  # type: ignore[attr-defined]
    elif request.messages:
        prompt_ids = chat_prompt_ids(request.messages, tokenizer)
    else:
        prompt_ids = []
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", given[0] if given else "prompt")
    _check_in_vocabulary("prompt token ids", prompt_ids, vocab_size, "prompt_token_ids")
    return prompt_ids


def chat_prompt_ids(messages: Sequence[generation_pb2.ChatMessage], tokenizer: object | None) -> list[int]:
    """`messages` rendered with the tokenizer's chat template, the assistant's turn opened, as token ids (exactly
    what `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` gives)."""
    tokenizer = _tokenizer(tokenizer, "messages")
    for i, message in enumerate(messages):
        if not message.role:
            raise InvalidRequest(f"messages[{i}] has no role", "messages")
    return render_chat([{"role": m.role, "content": m.content} for m in messages], tokenizer)


def render_chat(
    conversation: list[dict[str, Any]], tokenizer: object, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """`conversation` rendered with the tokenizer's chat template (its `tools` too, where given), the assistant's
    turn opened, as token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(
            "this model's tokenizer has no chat template, so messages cannot be formatted: send the prompt as text "
            "or token ids (prompt_token_ids), formatted as the model expects",
            "messages",
        )
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            conversation, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except TemplateError as exc:  # the template's own refusal (raise_exception), e.g. roles that do not alternate
        raise InvalidRequest(f"the chat template refused these messages: {exc}", "messages") from exc
    return list(ids)


def _tokenizer(tokenizer: object | None, field: str) -> object:
    if tokenizer is None:
        raise InvalidRequest(f"this server has no tokenizer, so it cannot read {field}: send prompt_token_ids", field)
    return tokenizer


def sampling_config(
    params: generation_pb2.SamplingParams,
    prompt_length: int,
    vocab_size: int,
    context: int,
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
) -> SamplingConfig:
    """The request's sampling, checked and defaulted (a random seed where it gives none). `context`: the tokens a
    sequence may hold, prompt and output; `default_max_tokens`: max_tokens when unset (None: the rest of the
    context, as OpenAI's chat completions)."""
    if params.HasField("max_tokens"):
        if params.max_tokens < 1:
            raise InvalidRequest(
                f"max_tokens must be >= 1 (leave it unset for the default), got {params.max_tokens}", "max_tokens"
            )
        max_tokens = params.max_tokens
    else:
        max_tokens = default_max_tokens if default_max_tokens is not None else max(context - prompt_length, 1)
    _check_length(prompt_length, max_tokens, context)
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0 (0 is greedy), got {params.temperature}", "temperature")
    # Unset is 1.0 (off); a set 0 is an error, not "unset": it would keep no token at all.
    top_p = params.top_p if params.HasField("top_p") else 1.0
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1] (leave it unset for 1), got {top_p}", "top_p")
    if params.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {params.top_k}", "top_k")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(params.stop_token_ids)}",
            "stop_token_ids",
        )
    _check_in_vocabulary("stop_token_ids", params.stop_token_ids, vocab_size, "stop_token_ids")
    _check_penalties(params, max_tokens)
    _check_logit_bias(params.logit_bias, vocab_size)
    return SamplingConfig.from_proto(params, max_tokens=max_tokens, seed=secrets.randbits(63))


def _check_penalties(params: generation_pb2.SamplingParams, max_tokens: int) -> None:
    """logprobs, min_tokens, min_p and the penalties in their ranges (OpenAI's for presence and frequency)."""
    if params.HasField("logprobs") and params.logprobs > MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be at most {MAX_LOGPROBS}, got {params.logprobs}", "logprobs")
    if params.HasField("prompt_logprobs") and params.prompt_logprobs > MAX_LOGPROBS:
        message = f"prompt_logprobs must be at most {MAX_LOGPROBS}, got {params.prompt_logprobs}"
        raise InvalidRequest(message, "prompt_logprobs")
    if params.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    if not 0 <= params.min_p <= 1:  # (a NaN fails too)
        raise InvalidRequest(f"min_p must be in [0, 1] (0 disables it), got {params.min_p}", "min_p")
    if params.HasField("repetition_penalty") and not (
        math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0
    ):
        raise InvalidRequest(
            f"repetition_penalty must be > 0 (1 disables it; leave it unset for 1), got {params.repetition_penalty}",
            "repetition_penalty",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2 <= value <= 2:
            raise InvalidRequest(f"{name} must be in [-2, 2] (0 disables it), got {value}", name)


def _check_logit_bias(bias: Mapping[int, float], vocab_size: int) -> None:
    """At most MAX_LOGIT_BIAS token ids of the vocabulary, each biased within [-100, 100] (OpenAI's limits)."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}", "logit_bias")
    _check_in_vocabulary("logit_bias token ids", list(bias), vocab_size, "logit_bias")
    for token, value in bias.items():
        if not -100 <= value <= 100:  # (a NaN fails too)
            raise InvalidRequest(f"logit_bias[{token}] must be in [-100, 100], got {value}", "logit_bias")


def _check_length(prompt_length: int, max_tokens: int, context: int) -> None:
    if prompt_length >= context:
        raise InvalidRequest(
            f"the prompt has {prompt_length} tokens; this server's context is {context} tokens", "prompt"
        )
    if prompt_length + max_tokens > context:
        raise InvalidRequest(
            f"prompt ({prompt_length} tokens) + max_tokens ({max_tokens}) = {prompt_length + max_tokens} "
            f"exceeds the context length of {context} tokens; lower max_tokens to {context - prompt_length}",
            "max_tokens",
        )


def _check_in_vocabulary(what: str, token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary [0, {vocab_size})", param)
