"""The step loop's stream outbox delivers held messages in order, after the next worker calls (not a proposal made
alone), within MAX_HOLD_S."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from stack import TinyPairs, Workers, generate, in_process_coordinator, run_async, text_prompts

from coordinator import stream_outbox
from coordinator.stream_outbox import MAX_HOLD_S, StreamOutbox
from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]


def _message(token: int) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(token_ids=[token])


def test_held_messages_arrive_after_the_calls_made_in_the_same_pass() -> None:
    """As grpc.aio does, a call schedules the task that sends its request when it is made; psd makes two calls in
    two tasks of one loop pass. Both sends run before any client stream is woken."""

    async def main() -> list[str]:
        streams: list[asyncio.Queue[generation_pb2.GenerateResponse]]
        outbox, streams, order = StreamOutbox(), [asyncio.Queue(), asyncio.Queue()], []
        for i, stream in enumerate(streams):
            outbox.hold(stream, _message(i))

        async def reader(i: int) -> None:
            order.append(f"stream {i}: {(await streams[i].get()).token_ids[0]}")

        readers = [asyncio.create_task(reader(i)) for i in range(2)]
        await asyncio.sleep(0)  # the readers wait on their streams

        async def send(name: str) -> None:
            order.append(f"sent {name}")

        async def worker_call(name: str) -> None:
            sending = asyncio.ensure_future(send(name))  # what making a grpc.aio call schedules
            outbox.call_started()
            await sending

        await asyncio.gather(worker_call("verify"), worker_call("propose"))
        await asyncio.gather(*readers)
        return order

    assert asyncio.run(main()) == ["sent verify", "sent propose", "stream 0: 0", "stream 1: 1"]


def test_nothing_is_held_longer_than_the_bound() -> None:
    async def main() -> tuple[float, list[int]]:
        stream: asyncio.Queue[generation_pb2.GenerateResponse]
        outbox, stream = StreamOutbox(), asyncio.Queue()
        start = time.perf_counter()
        outbox.hold(stream, _message(1))
        outbox.hold(stream, _message(2))
        await asyncio.sleep(0)
        assert stream.empty()
        first = await stream.get()
        return time.perf_counter() - start, [first.token_ids[0], stream.get_nowait().token_ids[0]]

    waited, tokens = asyncio.run(main())
    assert tokens == [1, 2] and MAX_HOLD_S * 0.9 <= waited < MAX_HOLD_S + 0.5


def test_a_flush_delivers_at_once_and_cancels_the_deadline() -> None:
    async def main() -> int:
        stream: asyncio.Queue[generation_pb2.GenerateResponse]
        outbox, stream = StreamOutbox(), asyncio.Queue()
        outbox.hold(stream, _message(7))
        outbox.flush()
        assert stream.get_nowait().token_ids == [7]
        outbox.call_started()  # nothing held: schedules nothing
        await asyncio.sleep(MAX_HOLD_S * 2)
        return stream.qsize()

    assert asyncio.run(main()) == 0


def test_a_proposal_made_alone_does_not_wake_the_streams(
    llama_workers: Workers, tiny_pairs: TinyPairs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sd proposes, then verifies one batch: the held messages wait for the Verify, so that the stream handlers run
    while it computes, not during the proposal that it waits for (on one H200 they made the proposal's call 5.5 ms,
    3.0 without them)."""
    monkeypatch.setattr(stream_outbox, "MAX_HOLD_S", 60.0)  # (a slow machine's proposal must not run into it)
    prompts = text_prompts(tiny_pairs.tokenizer, 4, 8, 16, seed=3)
    calls: list[str] = []  # worker calls as they are made, and "flush" where held messages went out

    async def serve() -> None:
        async with in_process_coordinator(llama_workers, mode="sd", speculation="always") as (address, coordinator):
            workers, outbox = coordinator.workers, coordinator.loop.outbox
            for name in ("propose", "verify", "prefill_target"):

                def noting(call: Callable[..., Awaitable[Any]], name: str = name) -> Callable[..., Awaitable[Any]]:
                    async def noted(*args: Any, **kwargs: Any) -> Any:
                        calls.append(name)
                        return await call(*args, **kwargs)

                    return noted

                monkeypatch.setattr(workers, name, noting(getattr(workers, name)))
            flush = outbox.flush

            def noted_flush() -> None:
                if outbox._held:
                    calls.append("flush")
                flush()

            monkeypatch.setattr(outbox, "flush", noted_flush)
            await asyncio.gather(
                *(
                    generate(
                        address,
                        generation_pb2.GenerateRequest(
                            prompt_token_ids=p, params=generation_pb2.SamplingParams(max_tokens=12, ignore_eos=True)
                        ),
                    )
                    for p in prompts
                )
            )

    run_async(serve())
    woken_after = [calls[i - 1] for i, call in enumerate(calls) if call == "flush"]
    assert woken_after.count("verify") >= 8, calls
    assert "propose" not in woken_after, calls
