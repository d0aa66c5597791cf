"""An HTTP request's answers: its generations' messages as OpenAI's choices, whole or as server-sent events, and
OpenAI's error objects of what the front door refuses."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from coordinator.front_door import FrontDoor, Generation, RequestRefused
from coordinator.openai_schema import Reply, TokenEntry, error_body, finish_reason, tool_calls_reason
from coordinator.samples import total_usage
from coordinator.tool_calls import ToolCallStream
from minedraft.proto import generation_pb2

# gRPC status -> HTTP status and OpenAI's error type; anything else is a 500 server_error.
STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
}
# Names of gRPC request fields in the HTTP API, for an error's `param`.
PARAMS = {"prompt_token_ids": "prompt", "stop_token_ids": "stop_token_ids"}


class ApiError(Exception):
    """An error answered as OpenAI's error object with this HTTP status."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)

    @staticmethod
    def of(refused: RequestRefused) -> ApiError:
        status, kind = STATUS.get(refused.code, (500, "server_error"))
        param = PARAMS.get(refused.param, refused.param) if refused.param else None
        return ApiError(status, refused.message, kind, param, refused.code.name.lower())


Entries = Callable[[generation_pb2.GenerateResponse], list[TokenEntry]]


def token_entries(generate: generation_pb2.GenerateRequest, tokenizer: object | None, chat: bool) -> Entries | None:
    """How a message's tokens become its logprobs' entries, each token's text decoded alone ("token_id:N" without
    a tokenizer, as vLLM's return_tokens_as_token_ids), if the request asked for logprobs. A chat's leave out the
    special tokens (an end of turn such as <|im_end|>) that its text, decoded without them, does not hold."""
    if not generate.params.HasField("logprobs"):
        return None
    special = set(getattr(tokenizer, "all_special_ids", ())) if chat else set()
    text = token_text(tokenizer)

    def entries(message: generation_pb2.GenerateResponse) -> list[TokenEntry]:
        return [
            (text(token_id), lp.logprob, [(text(top.token_id), top.logprob) for top in lp.top])
            for token_id, lp in zip(message.token_ids, message.logprobs, strict=True)
            if token_id not in special
        ]

    return entries


def token_text(tokenizer: object | None) -> Callable[[int], str]:
    """A token's text, decoded alone ("token_id:N" without a tokenizer)."""

    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"  # type: ignore[attr-defined]

    return text


Choice = tuple[str, str | None, list[TokenEntry] | None]


@dataclass(frozen=True)
class Echo:
    """A completion's `echo`: each choice's text (and logprobs) begins with its prompt's, the first token's
    log-probability null; `prompt_only` (max_tokens 0, what lm-eval's loglikelihood sends): nothing after it."""

    prompts: list[str | list[int]]
    prompt_only: bool = False
    top: int = 0  # the top ones each echoed token's logprobs list (logprobs; prompt_logprobs may ask for more)


class Answers:
    """The admitted generations of one HTTP request, whose choices are numbered on from one prompt to the next."""

    def __init__(
        self,
        front: FrontDoor,
        generations: list[Generation],
        logprobs: Entries | None,
        echo: Echo | None = None,
        prompt_logprobs: bool = False,
    ) -> None:
        self.front, self.generations, self.logprobs, self.echo = front, generations, logprobs, echo
        self.bases = list(itertools.accumulate((choice_count(g) for g in generations), initial=0))
        # vLLM's prompt_logprobs, each choice's (`vllm_prompt_logprobs`), once `collect` has read its first message
        self.prompt_logprobs: list[list[dict[str, dict[str, Any]] | None]] | None = None
        if prompt_logprobs:
            self.prompt_logprobs = [[] for _ in range(self.count)]

    def vllm_prompt_logprobs(
        self, index: int, message: generation_pb2.GenerateResponse
    ) -> list[dict[str, dict[str, Any]] | None]:
        """Choice `index`'s prompt's logprobs as vLLM answers `prompt_logprobs`: None for the first token, then per
        token {token id: {logprob, rank, decoded_token}} of the token itself and the top ones (rank: 1 for the
        likeliest; the prompt token's null where it is not among the top ones, which are all the target reports)."""
        ids = self.generations[bisect.bisect_right(self.bases, index) - 1].state.prompt_ids
        text = token_text(self.front.tokenizer)
        answer: list[dict[str, dict[str, Any]] | None] = [None]
        for token_id, lp in zip(ids[1:], message.prompt_logprobs, strict=False):
            tops = [(top.token_id, top.logprob) for top in lp.top]
            rank = next((r for r, (t, _) in enumerate(tops, 1) if t == token_id), None)
            position = {str(token_id): {"logprob": lp.logprob, "rank": rank, "decoded_token": text(token_id)}}
            for r, (t, logprob) in enumerate(tops, 1):
                position.setdefault(str(t), {"logprob": logprob, "rank": r, "decoded_token": text(t)})
            answer.append(position)
        return answer

    def prompt_tokens(self, index: int) -> int:
        """The prompt tokens of choice `index`'s prompt."""
        return len(self.generations[bisect.bisect_right(self.bases, index) - 1].state.prompt_ids)

    def echoed(self, index: int, message: generation_pb2.GenerateResponse) -> tuple[str, list[TokenEntry] | None]:
        """Choice `index`'s prompt as its answer begins with it (`Echo`): its text, and its tokens' entries (the
        target's, from the choice's first message) where logprobs were asked."""
        assert self.echo is not None
        which = bisect.bisect_right(self.bases, index) - 1
        prompt, ids = self.echo.prompts[which], self.generations[which].state.prompt_ids
        tokenizer: Any = self.front.tokenizer
        text = prompt if isinstance(prompt, str) else (tokenizer.decode(ids) if tokenizer is not None else "")
        if self.logprobs is None:
            return text, None
        token = token_text(tokenizer)
        entries: list[TokenEntry] = [(token(ids[0]), None, None)]
        for token_id, lp in zip(ids[1:], message.prompt_logprobs, strict=False):
            tops = [(token(top.token_id), top.logprob) for top in lp.top[: self.echo.top]]
            entries.append((token(token_id), lp.logprob, tops))
        return text, entries

    @property
    def count(self) -> int:
        return self.bases[-1]

    async def messages(self) -> AsyncIterator[tuple[int, generation_pb2.GenerateResponse]]:
        """Every generation's messages as they come, each with its choice's index in the answer."""
        if len(self.generations) == 1:
            async for message in self.front.responses(self.generations[0]):
                yield message.index, message
            return
        merged: asyncio.Queue[tuple[int, generation_pb2.GenerateResponse] | BaseException | None] = asyncio.Queue()

        async def pump(generation: Generation, base: int) -> None:
            try:
                async for message in self.front.responses(generation):
                    merged.put_nowait((base + message.index, message))
                merged.put_nowait(None)
            except BaseException as exc:  # (its failure is the answer's: passed on below)
                merged.put_nowait(exc)

        pumps = [asyncio.ensure_future(pump(g, b)) for g, b in zip(self.generations, self.bases, strict=False)]
        try:
            running = len(pumps)
            while running:
                item = await merged.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in pumps:
                task.cancel()

    async def collect(self) -> list[Choice]:
        """Each choice's text, finish reason and logprobs (when asked), by index."""
        texts: list[list[str]] = [[] for _ in range(self.count)]
        reasons: list[str | None] = [None] * self.count
        entries: list[list[TokenEntry] | None] = [[] if self.logprobs else None for _ in range(self.count)]
        echoed: set[int] = set()
        async for index, message in self.messages():
            reasons[index] = finish_reason(message.finish_reason)
            if self.prompt_logprobs is not None and message.prompt_logprobs:  # (a choice's first message)
                self.prompt_logprobs[index] = self.vllm_prompt_logprobs(index, message)
            if self.echo is not None and index not in echoed:
                echoed.add(index)
                text, prompt_entries = self.echoed(index, message)
                texts[index].append(text)
                entries[index] = prompt_entries
            if self.echo is not None and self.echo.prompt_only:
                reasons[index] = reasons[index] and "length"  # (its one token generated is not answered)
                continue
            texts[index].append(message.text)
            if self.logprobs is not None:
                entries[index] += self.logprobs(message)  # type: ignore[operator]
        return [("".join(text), reason, e) for text, reason, e in zip(texts, reasons, entries, strict=True)]

    def usage(self) -> generation_pb2.Usage | None:
        """All prompts' usage together (each prompt's samples as `total_usage` counts them), once all finished."""
        usages = [g.usage for g in self.generations if g.usage is not None]
        if len(usages) < len(self.generations):
            return None
        if len(usages) == 1 and (self.echo is None or not self.echo.prompt_only):
            return usages[0]
        total = generation_pb2.Usage()
        total.CopyFrom(total_usage(usages))
        total.prompt_tokens = sum(u.prompt_tokens for u in usages)
        total.cached_prompt_tokens = sum(u.cached_prompt_tokens for u in usages)
        if self.echo is not None and self.echo.prompt_only:
            total.completion_tokens = 0
        return total


def choice_count(generation: Generation) -> int:
    return max(len(generation.samples), 1)


def sse_event(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n"


async def answer_events(answers: Answers, reply: Reply) -> AsyncIterator[str]:
    """The answer as server-sent events, as OpenAI streams it: (chat: the role first), text deltas (each with its
    tokens' logprobs, when asked), a chunk with the finish reason, the usage if asked, then [DONE]; a failure midway
    is an error object before [DONE]."""
    offsets = [0] * answers.count  # each choice's text so far (a completion's text_offset)
    calls = [ToolCallStream(reply.tools) for _ in range(answers.count)] if reply.tools is not None else None
    echoed: set[int] = set()
    generated = [0] * answers.count  # each choice's tokens so far (continuous usage)

    def sse(chunk: dict[str, Any], i: int) -> str:
        """A chunk of choice `i`; with continuous usage stats (vLLM's) its usage so far."""
        if reply.continuous_usage:
            prompt = answers.prompt_tokens(i)
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": generated[i],
                "total_tokens": prompt + generated[i],
            }
        return sse_event(chunk)

    for index in range(answers.count):
        opening = reply.opening(index)
        if opening is not None:
            yield sse_event(opening)
    try:
        async for i, message in answers.messages():
            generated[i] += len(message.token_ids)
            if answers.echo is not None and i not in echoed:
                echoed.add(i)
                text, prompt_entries = answers.echoed(i, message)
                yield sse(reply.delta(text, index=i, entries=prompt_entries), i)
                offsets[i] += sum(len(token) for token, _, _ in prompt_entries or ())
            if answers.echo is not None and answers.echo.prompt_only:
                if message.finish_reason:
                    yield sse(reply.delta("", "length", i), i)
                continue
            logprobs = answers.logprobs
            entries = logprobs(message) if logprobs is not None and message.token_ids else None
            text = message.text if calls is None else calls[i].feed(message.text)
            if text or entries:
                yield sse(reply.delta(text, index=i, entries=entries, offset=offsets[i]), i)
                offsets[i] += sum(len(token) for token, _, _ in entries or ())
            reason = finish_reason(message.finish_reason)
            if reason is not None and calls is not None:
                rest, made = calls[i].finish()
                if rest:
                    yield sse(reply.delta(rest, index=i), i)
                if made:
                    yield sse(reply.tool_calls_delta(made, i), i)
                    reason = tool_calls_reason(reason)
            if reason is not None:
                yield sse(reply.delta("", reason, i), i)
        usage = answers.usage()
        if reply.include_usage and usage is not None:
            yield sse_event(reply.usage_chunk(usage))
    except RequestRefused as exc:
        yield sse_event(ApiError.of(exc).body)
    yield sse_event("[DONE]")
