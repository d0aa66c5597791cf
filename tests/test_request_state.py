"""Streaming text: incremental detokenization equals a full decode, and stop strings cut the text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordinator.request_state import FINISH, RequestState
from minedraft.demo_models import TARGET_DIR, available
from minedraft.engine.sampling import SamplingConfig

pytestmark = pytest.mark.skipif(not available(), reason="the demo pair's tokenizer is not there")


@pytest.fixture(scope="module")
def tokenizer() -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TARGET_DIR))


def _stream(
    tokenizer: object, ids: list[int], step: int, stops: tuple[str, ...] = (), lag: int = 0
) -> tuple[RequestState, str]:
    """Emit `ids` `step` at a time; the stream's reader takes messages `lag` emits behind (a busy event loop)."""
    request = RequestState(1, [1], SamplingConfig(), stops, tokenizer)
    streamed = ""
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        request.emit(ids[i : i + step], FINISH.FINISH_REASON_LENGTH if last else FINISH.FINISH_REASON_UNSPECIFIED)
        while request.client.queue.qsize() > lag or (request.finished and not request.client.queue.empty()):
            streamed += request.render(request.client.queue.get_nowait()).text  # type: ignore[arg-type]
        if request.finished:
            break
    return request, streamed


@pytest.mark.parametrize("step", [1, 3, 5])
@pytest.mark.parametrize("lag", [0, 4])
def test_streamed_text_equals_a_full_decode(tokenizer: object, step: int, lag: int) -> None:
    text = Path(os.__file__).read_text()[:3000] + " héllo wörld ✓ 中文 🙂\n"
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    request, streamed = _stream(tokenizer, ids, step, lag=lag)
    assert streamed == request.text == tokenizer.decode(ids, skip_special_tokens=True)  # type: ignore[attr-defined]


@pytest.mark.parametrize("lag", [0, 3])
def test_stop_string_ends_the_stream_before_it(tokenizer: object, lag: int) -> None:
    ids = tokenizer.encode("def f(x):\n    return x\n\ndef g(y):\n    pass\n")  # type: ignore[attr-defined]
    request, streamed = _stream(tokenizer, ids, 2, stops=("def g",), lag=lag)
    assert request.finish_reason == FINISH.FINISH_REASON_STOP
    assert streamed == request.text == "def f(x):\n    return x\n\n"


def test_accepted_tokens_count_only_the_drafts_that_were_emitted() -> None:
    """A self-drafted run (every draft accepted) whose last verify is cut by max_tokens: the drafts past the cut were
    never returned, so usage must not count them (it once reported 66 accepted of 64 completion tokens)."""
    k, max_tokens = 4, 12
    request = RequestState(1, [1, 2], SamplingConfig(max_tokens=max_tokens, ignore_eos=True), (), None)
    request.emit([7], FINISH.FINISH_REASON_UNSPECIFIED)  # prefill's token
    while not request.finished:
        room = max_tokens - len(request.output_ids)
        emitted = min(k + 1, room)  # the target trims the step to the budget
        request.record_verify(k, k, emitted)
        done = emitted == room
        request.emit([7] * emitted, FINISH.FINISH_REASON_LENGTH if done else FINISH.FINISH_REASON_UNSPECIFIED)
    usage = request.usage()
    assert usage.completion_tokens == max_tokens
    assert usage.accepted_tokens == 4 + 4 + 1 <= usage.completion_tokens  # 1+5+5+1 tokens: the last is a draft
    assert list(usage.accepted_per_position) == [3, 2, 2, 2]
    assert usage.mean_accepted_length == pytest.approx(9 / 3 + 1)
