"""The step loop's stream outbox delivers held messages in order, after the next worker calls, within MAX_HOLD_S."""

from __future__ import annotations

import asyncio
import time

from coordinator.stream_outbox import MAX_HOLD_S, StreamOutbox
from minedraft.proto import generation_pb2


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
