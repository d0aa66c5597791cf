"""One client request inside the coordinator: what it asked (`Request`), its decode progress (`Decode`, the step
loop's) and what its client has been sent (`ClientStream`, the front door's), held together by `RequestState`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minedraft.engine.sampling import SamplingConfig
from minedraft.observability.metrics import mean_accepted_length
from minedraft.proto import generation_pb2

if TYPE_CHECKING:
    from coordinator.stream_outbox import StreamOutbox

FINISH = generation_pb2
Message = generation_pb2.GenerateResponse


@dataclass(frozen=True)
class Request:
    """What the client asked, as admitted: never changes."""

    seq_id: int
    prompt_ids: list[int]
    config: SamplingConfig
    stop_strings: tuple[str, ...]
    tokenizer: object | None
    # Sampled with the client's seed, so its output must not depend on when steps drafted (`StepLoop.step`)
    seeded: bool = False
    index: int = 0  # which sample of its request it is (GenerateRequest.n, `coordinator.samples`)
    created: float = field(default_factory=time.perf_counter)


@dataclass
class Decode:
    """How far the request has decoded: written by the step loop alone, through `RequestState`'s methods."""

    output_ids: list[int] = field(default_factory=list)
    finish_reason: int = FINISH.FINISH_REASON_UNSPECIFIED
    # The target's verdict on the draft's last proposal (0 after prefill), which the next proposal reconciles with,
    # and the index in `output_ids` of the token it emitted: the draft has cached none from there (the last it is
    # sent as the token to draft from, any before it as missed, after steps decoded without drafts).
    num_accepted: int = 0
    draft_from: int = 0
    steps: int = 0
    drafted_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # Output tokens the workers prefill with the prompt: those it had when last preempted (`preempt`).
    resumed_output: int = 0
    admitted: int = 0  # its place in the order of admissions (the latest is preempted first)
    preemptions: int = 0
    cached_prompt_tokens: int = 0  # of its first prefill on the target, from the prefix cache
    # Of its first prefill, with prompt_logprobs asked: sent with its first message, then dropped
    prompt_logprobs: Sequence[generation_pb2.TokenLogprob] = ()
    first_token_at: float | None = None


class Detokenizer:
    """Incremental detokenization of an output (as vLLM does): `advance` decodes only the newest tokens, not the
    whole output every step. Tokens from the prefix offset give the decoder its context (a leading space, a
    multi-byte character); text is added once it no longer ends in a partial UTF-8 character, or at the end."""

    def __init__(self, tokenizer: object) -> None:
        self._decode = tokenizer.decode  # type: ignore[attr-defined]
        self.text = ""
        self.sent = 0  # characters of `text` its client was sent
        self._prefix_offset = 0
        self._read_offset = 0

    def advance(self, ids: list[int], end: int, final: bool) -> None:
        """Extend `text` with `ids[:end]`."""
        prefix = self._decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self._decode(ids[self._prefix_offset : end], skip_special_tokens=True)
        if final or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, end

    def cut_at_stop(self, stop_strings: tuple[str, ...]) -> bool:
        """Whether the text holds a stop string; if so it ends before the first. Only text not yet sent can newly
        hold one (plus its length - 1 before it)."""
        positions = [pos for s in stop_strings if (pos := self.text.find(s, max(0, self.sent - len(s) + 1))) >= 0]
        if not positions:
            return False
        self.text = self.text[: min(positions)]
        return True

    def take(self) -> str:
        """The text its client has not been sent, now sent."""
        new, self.sent = self.text[self.sent :], len(self.text)
        return new


@dataclass
class ClientStream:
    """What the request's client is sent: the front door's. The step loop puts messages on `queue` (through the
    outbox); the front door reads them, fills their text in (`RequestState.render`) and marks the request
    `cancelled` when its client goes away."""

    queue: asyncio.Queue[Message | BaseException] = field(default_factory=asyncio.Queue)
    detokenizer: Detokenizer | None = None  # None without a tokenizer: token ids only
    rendered: int = 0  # output tokens whose messages were rendered
    cancelled: bool = False
    span: Any = None  # the request's trace span, when tracing is on (minedraft.observability.telemetry)


class RequestState:
    """A request's three parts: `request` (immutable), `decode` (the step loop's) and `client` (the front door's).
    The step loop moves it on through `emit`, `record_verify`, `preempt`, `finish` and `fail`; the front door
    through `render`. Samples of one request (`n`) share one client queue."""

    def __init__(
        self,
        seq_id: int,
        prompt_ids: list[int],
        config: SamplingConfig,
        stop_strings: tuple[str, ...],
        tokenizer: object | None,
        *,
        seeded: bool = False,
        index: int = 0,
        queue: asyncio.Queue[Message | BaseException] | None = None,
    ) -> None:
        self.request = Request(seq_id, prompt_ids, config, stop_strings, tokenizer, seeded, index)
        self.decode = Decode()
        self.client = ClientStream(detokenizer=Detokenizer(tokenizer) if tokenizer is not None else None)
        if queue is not None:
            self.client.queue = queue

    def __repr__(self) -> str:
        return f"RequestState(seq_id={self.seq_id}, output={len(self.output_ids)}, finished={self.finished})"

    # ----------------------------------------------------------------------------------------------- reading

    @property
    def seq_id(self) -> int:
        return self.request.seq_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def config(self) -> SamplingConfig:
        return self.request.config

    @property
    def index(self) -> int:
        return self.request.index

    @property
    def span(self) -> Any:
        return self.client.span

    @property
    def cancelled(self) -> bool:
        return self.client.cancelled

    @property
    def output_ids(self) -> list[int]:
        return self.decode.output_ids

    @property
    def finish_reason(self) -> int:
        return self.decode.finish_reason

    @property
    def finished(self) -> bool:
        return self.decode.finish_reason != FINISH.FINISH_REASON_UNSPECIFIED

    @property
    def text(self) -> str:
        """The text sent or to be sent so far ("" without a tokenizer)."""
        return self.client.detokenizer.text if self.client.detokenizer is not None else ""

    @property
    def prefill_ids(self) -> list[int]:
        """What the workers prefill: the prompt, and the output it had when last preempted."""
        return self.request.prompt_ids + self.decode.output_ids[: self.decode.resumed_output]

    @property
    def last_token(self) -> int:
        return self.decode.output_ids[-1]

    @property
    def missed_by_draft(self) -> list[int]:
        """Tokens before `last_token` that the draft has not cached (`Decode.draft_from`)."""
        return self.decode.output_ids[self.decode.draft_from : -1]

    # ----------------------------------------------------------------------------------------------- the step loop

    def admit(self, order: int) -> None:
        """Admitted `order`-th: the latest admitted is preempted first."""
        self.decode.admitted = order

    def prefilled(self, cached_prompt_tokens: int, prompt_logprobs: Sequence[generation_pb2.TokenLogprob] = ()) -> None:
        """Its prefill on the target found `cached_prompt_tokens` in the prefix cache and reported the prompt's
        log-probabilities where asked (both taken at its first prefill, not after a preemption)."""
        if not self.decode.preemptions:
            self.decode.cached_prompt_tokens = cached_prompt_tokens
            self.decode.prompt_logprobs = prompt_logprobs

    def drafted_from_here(self) -> None:
        """A draft service was handed it with its output so far but the last token, which the next proposal feeds."""
        self.decode.draft_from = len(self.decode.output_ids) - 1

    def preempt(self) -> None:
        """Its blocks freed for others: it waits to be prefilled again with its output so far, as a prompt whose
        next token the target samples at the position it would have had (lossless, seeded or not)."""
        d = self.decode
        d.resumed_output = len(d.output_ids)
        d.num_accepted, d.draft_from = 0, len(d.output_ids)
        d.preemptions += 1

    def record_verify(self, num_drafts: int, num_accepted: int, num_emitted: int, verified: int | None = None) -> None:
        """Before the verify's `num_emitted` tokens are emitted: fewer than `num_accepted` + 1 where an EOS, a stop
        token or max_tokens cut the step short. `verified`: of the `num_drafts` proposed, those the verify checked
        (TETRIS's selection; None: all), which usage counts."""
        d = self.decode
        d.steps += 1
        if num_drafts:
            # The draft reconciles with the target's whole verdict; usage counts only the drafts the client got.
            d.num_accepted, d.draft_from = num_accepted, len(d.output_ids) + num_accepted
            emitted_drafts = min(num_accepted, num_emitted)
            d.drafted_steps += 1
            d.draft_tokens += num_drafts if verified is None else verified
            d.accepted_tokens += emitted_drafts
            if len(d.accepted_per_position) < num_drafts:
                d.accepted_per_position += [0] * (num_drafts - len(d.accepted_per_position))
            for i in range(emitted_drafts):
                d.accepted_per_position[i] += 1

    def emit(
        self,
        token_ids: list[int],
        finish_reason: int,
        outbox: StreamOutbox | None = None,
        logprobs: Sequence[generation_pb2.TokenLogprob] = (),
    ) -> None:
        """Append what the target emitted, apply stop strings, and push one message to the client's queue (through
        `outbox`, which may hold it a moment).

        The message's text is filled in by `render` when the front door takes it, off the step loop's path: the
        loop goes on to its next step meanwhile. Only requests with stop strings detokenize here, since a stop
        string ends the request now.
        """
        d, detokenizer = self.decode, self.client.detokenizer
        if self.finished:
            return
        if d.first_token_at is None:
            d.first_token_at = time.perf_counter()
        d.output_ids += token_ids
        if detokenizer is not None and self.request.stop_strings:
            detokenizer.advance(
                d.output_ids, len(d.output_ids), final=finish_reason != FINISH.FINISH_REASON_UNSPECIFIED
            )
            if detokenizer.cut_at_stop(self.request.stop_strings):
                finish_reason = FINISH.FINISH_REASON_STOP
        d.finish_reason = finish_reason
        message = Message(
            token_ids=token_ids,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            index=self.index,
            logprobs=logprobs,
            prompt_logprobs=d.prompt_logprobs,
        )
        d.prompt_logprobs = ()
        if self.finished:
            message.usage.CopyFrom(self.usage())
        if outbox is None:
            self.client.queue.put_nowait(message)
        else:
            outbox.hold(self.client.queue, message)

    def finish(self, reason: int) -> None:
        """End the stream without new tokens (cancelled, or failed)."""
        if not self.finished:
            self.decode.finish_reason = reason
            self.client.queue.put_nowait(Message(finish_reason=reason, usage=self.usage(), index=self.index))  # type: ignore[arg-type]

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.decode.finish_reason = FINISH.FINISH_REASON_ERROR
            self.client.queue.put_nowait(error)

    # ----------------------------------------------------------------------------------------------- the front door

    def render(self, message: Message) -> Message:
        """Fill in the text a streamed message adds: its tokens decoded, in stream order."""
        client, detokenizer = self.client, self.client.detokenizer
        client.rendered += len(message.token_ids)
        if detokenizer is None:
            return message
        if not self.request.stop_strings:
            final = message.finish_reason != FINISH.FINISH_REASON_UNSPECIFIED
            detokenizer.advance(self.decode.output_ids, client.rendered, final)
        message.text = detokenizer.take()
        return message

    def usage(self) -> generation_pb2.Usage:
        d = self.decode
        done = time.perf_counter()
        ttft = (d.first_token_at or done) - self.request.created
        completion = len(d.output_ids)
        return generation_pb2.Usage(
            prompt_tokens=len(self.request.prompt_ids),
            completion_tokens=completion,
            draft_tokens=d.draft_tokens,
            accepted_tokens=d.accepted_tokens,
            steps=d.steps,
            drafted_steps=d.drafted_steps,
            mean_accepted_length=mean_accepted_length(d.accepted_tokens, d.drafted_steps, d.steps),
            acceptance_rate=d.accepted_tokens / d.draft_tokens if d.draft_tokens else 0.0,
            accepted_per_position=d.accepted_per_position,
            time_to_first_token_s=ttft,
            time_per_output_token_s=(done - (d.first_token_at or done)) / max(completion - 1, 1),
            cached_prompt_tokens=d.cached_prompt_tokens,
        )
