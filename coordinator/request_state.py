"""One client request inside the coordinator: its sequence state, incremental detokenization, usage, stream."""

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


@dataclass
class RequestState:
    seq_id: int
    prompt_ids: list[int]
    config: SamplingConfig
    stop_strings: tuple[str, ...]
    tokenizer: object | None
    # Sampled with the client's seed, so its output must not depend on when steps drafted (`StepLoop.step`)
    seeded: bool = False
    created: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_text_len: int = 0
    _prefix_offset: int = 0  # incremental detokenization: see _detokenize
    _read_offset: int = 0
    _rendered: int = 0  # output tokens whose messages the stream's reader took
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
    # The prefix cache keys of `prefill_ids` less its last token, and how many tokens they were made from: admission
    # asks for them at every step while it waits (`PrefixMemory`)
    block_keys: tuple[int, list[bytes]] = (-1, [])
    first_token_at: float | None = None
    cancelled: bool = False
    span: Any = None  # the request's trace span, when tracing is on (minedraft.observability.telemetry)
    index: int = 0  # which sample of its request it is (GenerateRequest.n, `coordinator.samples`)
    stream: asyncio.Queue[generation_pb2.GenerateResponse | BaseException] = field(default_factory=asyncio.Queue)

    @property
    def finished(self) -> bool:
        return self.finish_reason != FINISH.FINISH_REASON_UNSPECIFIED

    @property
    def prefill_ids(self) -> list[int]:
        """What the workers prefill: the prompt, and the output it had when last preempted."""
        return self.prompt_ids + self.output_ids[: self.resumed_output]

    @property
    def last_token(self) -> int:
        return self.output_ids[-1]

    @property
    def missed_by_draft(self) -> list[int]:
        """Tokens before `last_token` that the draft has not cached (`draft_from`)."""
        return self.output_ids[self.draft_from : -1]

    def preempt(self) -> None:
        """Its blocks freed for others: it waits to be prefilled again with its output so far, as a prompt whose
        next token the target samples at the position it would have had (lossless, seeded or not)."""
        self.resumed_output = len(self.output_ids)
        self.num_accepted, self.draft_from = 0, len(self.output_ids)
        self.preemptions += 1

    def record_verify(self, num_drafts: int, num_accepted: int, num_emitted: int) -> None:
        """Before the verify's `num_emitted` tokens are emitted: fewer than `num_accepted` + 1 where an EOS, a stop
        token or max_tokens cut the step short."""
        self.steps += 1
        if num_drafts:
            # The draft reconciles with the target's whole verdict; usage counts only the drafts the client got.
            self.num_accepted, self.draft_from = num_accepted, len(self.output_ids) + num_accepted
            emitted_drafts = min(num_accepted, num_emitted)
            self.drafted_steps += 1
            self.draft_tokens += num_drafts
            self.accepted_tokens += emitted_drafts
            if len(self.accepted_per_position) < num_drafts:
                self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
            for i in range(emitted_drafts):
                self.accepted_per_position[i] += 1

    def emit(
        self,
        token_ids: list[int],
        finish_reason: int,
        outbox: StreamOutbox | None = None,
        logprobs: Sequence[generation_pb2.TokenLogprob] = (),
    ) -> None:
        """Append what the target emitted, apply stop strings, and push one message to the client's stream (through
        `outbox`, which may hold it a moment).

        The message's text is filled in by `render` when the stream's reader takes it, off the step loop's path:
        the loop goes on to its next step meanwhile. Only requests with stop strings detokenize here, since a stop
        string ends the request now.
        """
        if self.finished:
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids += token_ids
        if self.tokenizer is not None and self.stop_strings:
            self._detokenize(len(self.output_ids), final=finish_reason != FINISH.FINISH_REASON_UNSPECIFIED)
            hit = self._first_stop_string()
            if hit is not None:
                self.text = self.text[:hit]
                finish_reason = FINISH.FINISH_REASON_STOP
        self.finish_reason = finish_reason
        message = generation_pb2.GenerateResponse(
            token_ids=token_ids,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            index=self.index,
            logprobs=logprobs,
        )
        if self.finished:
            message.usage.CopyFrom(self.usage())
        if outbox is None:
            self.stream.put_nowait(message)
        else:
            outbox.hold(self.stream, message)

    def render(self, message: generation_pb2.GenerateResponse) -> generation_pb2.GenerateResponse:
        """Fill in the text a streamed message adds: its tokens decoded, in stream order."""
        self._rendered += len(message.token_ids)
        if self.tokenizer is not None and not self.stop_strings:
            self._detokenize(self._rendered, final=message.finish_reason != FINISH.FINISH_REASON_UNSPECIFIED)
        message.text, self.sent_text_len = self.text[self.sent_text_len :], len(self.text)
        return message

    def _detokenize(self, end: int, final: bool) -> None:
        """Extend `text` with `output_ids[:end]` by decoding only the newest tokens (as vLLM does), not the whole
        output every step.

        Tokens from `_prefix_offset` give the decoder its context (a leading space, a multi-byte character); text
        is added once it no longer ends in a partial UTF-8 character, or at the end whatever it is.
        """
        decode = self.tokenizer.decode  # type: ignore[union-attr]
        ids = self.output_ids
        prefix = decode(ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(ids[self._prefix_offset : end], skip_special_tokens=True)
        if final or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self._prefix_offset, self._read_offset = self._read_offset, end

    def _first_stop_string(self) -> int | None:
        # Only text not yet streamed can newly contain a stop string (plus its length - 1 before it).
        positions = [
            pos for s in self.stop_strings if (pos := self.text.find(s, max(0, self.sent_text_len - len(s) + 1))) >= 0
        ]
        return min(positions) if positions else None

    def finish(self, reason: int) -> None:
        """End the stream without new tokens (cancelled, or failed)."""
        if not self.finished:
            self.finish_reason = reason
            self.stream.put_nowait(
                generation_pb2.GenerateResponse(finish_reason=reason, usage=self.usage(), index=self.index)  # type: ignore[arg-type]
            )

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.finish_reason = FINISH.FINISH_REASON_ERROR
            self.stream.put_nowait(error)

    def usage(self) -> generation_pb2.Usage:
        done = time.perf_counter()
        ttft = (self.first_token_at or done) - self.created
        completion = len(self.output_ids)
        return generation_pb2.Usage(
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=completion,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            steps=self.steps,
            drafted_steps=self.drafted_steps,
            mean_accepted_length=mean_accepted_length(self.accepted_tokens, self.drafted_steps, self.steps),
            acceptance_rate=self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
            accepted_per_position=self.accepted_per_position,
            time_to_first_token_s=ttft,
            time_per_output_token_s=(done - (self.first_token_at or done)) / max(completion - 1, 1),
            cached_prompt_tokens=self.cached_prompt_tokens,
        )
