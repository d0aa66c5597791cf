"""Step calls as messages on a worker's stream: each its own call, replies in order, failures as unary calls fail."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import cast

import grpc
import pytest
from stack import Workers, generate, in_process_coordinator, leased_channel, run_async

from coordinator.request_state import RequestState
from coordinator.workers import Workers as WorkerClients
from minedraft.demo_models import TARGET_DIR
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import common_pb2, generation_pb2, target_pb2, target_pb2_grpc
from minedraft.rpc import worker as worker_module
from minedraft.rpc.options import WorkerOptions
from minedraft.rpc.step_stream import StepStream, serve_step_stream
from minedraft.rpc.worker import ModelWorker

pytest_plugins = ["stack"]

PROMPT = [5, 17, 42, 99, 7, 3]
SERVICE = "minedraft.v1.TargetService"


async def _prefill(stub: target_pb2_grpc.TargetServiceStub, seq_id: int) -> None:
    params = generation_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    await stub.Prefill(
        target_pb2.TargetServicePrefillRequest(
            sequences=[common_pb2.SequenceSpec(seq_id=seq_id, prompt_token_ids=PROMPT, params=params)]
        ),
        timeout=60,
    )


def _decode(seq_id: int, step_id: int) -> target_pb2.VerifyRequest:
    """A verify without drafts (the target decodes one token), on batch 0."""
    return target_pb2.VerifyRequest(step_id=step_id, batch_id=0, seq_ids=[seq_id], num_draft_tokens=0)


def test_a_failed_call_leaves_the_stream_open_and_calls_sent_together_are_answered_in_order(
    llama_workers: Workers,
) -> None:
    on_stream, on_unary = 10**9 + 11, 10**9 + 12

    async def main() -> tuple[list[int], list[int], int]:
        async with leased_channel(llama_workers.target.address) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            stream = StepStream(stub.VerifyStream, target_pb2.VerifyStreamRequest)
            try:
                await _prefill(stub, on_stream)
                await _prefill(stub, on_unary)
                # All three sent before any reply: the worker handles them as they come, and answers in turn.
                bad = stream.call(target_pb2.VerifyRequest(step_id=1, batch_id=5, seq_ids=[on_stream]), 60)
                good = [stream.call(_decode(on_stream, step), 60) for step in (2, 3, 4)]
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await bad
                assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "batch_id must be 0 or 1" in str(error.value.details())
                streamed = [(await reply).results[0].token_ids[0] for reply in good]
                unary = [
                    (await stub.Verify(_decode(on_unary, step), timeout=60)).results[0].token_ids[0]
                    for step in (2, 3, 4)
                ]
                return streamed, unary, stream.opened
            finally:
                await stream.close()
                await stub.Release(target_pb2.TargetServiceReleaseRequest(seq_ids=[on_stream, on_unary]), timeout=60)

    streamed, unary, opened = run_async(main())  # type: ignore[misc]
    assert streamed == unary  # the same tokens as unary calls, in the order of the calls
    assert opened == 1  # the failed call did not end the stream


class _FakeTarget:
    """A target service's gRPC surface for what no real worker does: answer nothing on its first stream (hung), or
    have no stream at all (a worker older than the streams). Replies carry the request's step id as their sequence."""

    def __init__(self, streams: bool) -> None:
        self.streams_opened = 0
        self.unary_calls = 0
        handlers = {
            "Verify": grpc.unary_unary_rpc_method_handler(
                self._verify,
                request_deserializer=target_pb2.VerifyRequest.FromString,
                response_serializer=target_pb2.VerifyResponse.SerializeToString,
            )
        }
        if streams:
            handlers["VerifyStream"] = grpc.stream_stream_rpc_method_handler(
                self._verify_stream,
                request_deserializer=target_pb2.VerifyStreamRequest.FromString,  # type: ignore[arg-type]
                response_serializer=target_pb2.VerifyStreamResponse.SerializeToString,
            )
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    @staticmethod
    def _reply(request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        return target_pb2.VerifyResponse(results=[target_pb2.SequenceResult(seq_id=request.step_id)])

    async def _verify(self, request: target_pb2.VerifyRequest, context: object) -> target_pb2.VerifyResponse:
        self.unary_calls += 1
        return self._reply(request)

    async def _verify_stream(
        self, requests: AsyncIterator[target_pb2.VerifyStreamRequest], context: object
    ) -> AsyncIterator[target_pb2.VerifyStreamResponse]:
        self.streams_opened += 1
        hung = self.streams_opened == 1
        async for envelope in requests:
            if not hung:
                yield target_pb2.VerifyStreamResponse(verify=self._reply(envelope.verify))


@contextlib.asynccontextmanager
async def _stream_to_fake_target() -> AsyncIterator[tuple[StepStream, _FakeTarget]]:
    fake = _FakeTarget(streams=True)
    await fake.server.start()
    try:
        async with grpc.aio.insecure_channel(fake.address) as channel:
            stream = StepStream(target_pb2_grpc.TargetServiceStub(channel).VerifyStream, target_pb2.VerifyStreamRequest)
            try:
                yield stream, fake
            finally:
                await stream.close()
    finally:
        await fake.server.stop(None)


def test_a_call_past_its_deadline_fails_every_call_on_its_stream_and_the_next_call_opens_a_new_one() -> None:
    async def main() -> None:
        async with _stream_to_fake_target() as (stream, fake):
            first, second = stream.call(_decode(1, 1), 0.5), stream.call(_decode(1, 2), 60)
            for call in (first, second):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call
                assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            replies = [stream.call(_decode(1, step), 5) for step in (3, 4)]
            assert [(await reply).results[0].seq_id for reply in replies] == [3, 4]
            assert stream.opened == fake.streams_opened == 2

    run_async(main())


def test_a_worker_without_step_streams_gets_unary_calls() -> None:
    async def main() -> None:
        fake = _FakeTarget(streams=False)
        await fake.server.start()
        workers = WorkerClients(fake.address, None)
        try:
            member = RequestState(1, PROMPT, SamplingConfig(), (), None)
            for step in (5, 6):
                reply = await workers.verify(step, 0, [member], None, 0)
                assert reply.results[0].seq_id == step
            assert workers.target.stream is not None and workers.target.stream.unimplemented
            assert fake.unary_calls == 2
        finally:
            await workers.close()
            await fake.server.stop(None)

    run_async(main())


class _SendRacedUnimplemented:
    """A step stream's call as grpc leaves it when an older worker's UNIMPLEMENTED closes the stream while our first
    message is being sent: the send fails and the call ends INTERNAL (a race seen once in CI; written here, since it
    cannot be made to happen on demand). `replies`: envelopes read before that."""

    def __init__(self, replies: list[target_pb2.VerifyStreamResponse]) -> None:
        self.replies = replies

    async def _responses(self) -> AsyncIterator[target_pb2.VerifyStreamResponse]:
        for reply in self.replies:
            yield reply
        debug = 'Failed "execute_batch": (<grpc._cython.cygrpc.SendMessageOperation object at 0x7f>,)'
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core", debug
        )

    def __aiter__(self) -> AsyncIterator[target_pb2.VerifyStreamResponse]:
        return self._responses()

    def cancel(self) -> bool:
        return True


def test_a_first_send_that_lost_the_race_to_unimplemented_means_no_step_streams() -> None:
    """The first stream closed before any reply by a failed send: an older worker (the call goes again, unary);
    after a reply, or on a later stream, the same error is the worker's failure, and the caller gets it."""

    async def main() -> None:
        for replies, opened_before, unimplemented in (([], 0, True), ([], 1, False), ([_verified(1)], 0, False)):
            call = cast(grpc.aio.StreamStreamCall, _SendRacedUnimplemented(replies))
            stream = StepStream(functools.partial(_opened, call), target_pb2.VerifyStreamRequest)
            stream.opened = opened_before
            calls = [stream.call(_decode(1, step), 5) for step in range(len(replies) + 1)]
            with pytest.raises(grpc.aio.AioRpcError):
                await calls[-1]
            assert stream.unimplemented is unimplemented, (replies, opened_before)
            await stream.close()

    run_async(main())


def _opened(call: grpc.aio.StreamStreamCall, requests: AsyncIterator[object]) -> grpc.aio.StreamStreamCall:
    return call


def _verified(seq_id: int) -> target_pb2.VerifyStreamResponse:
    result = target_pb2.SequenceResult(seq_id=seq_id)
    return target_pb2.VerifyStreamResponse(verify=target_pb2.VerifyResponse(results=[result]))


def test_unary_step_calls_give_the_same_output(llama_workers: Workers, stack_logs: Path) -> None:
    """--step-calls unary (each Verify and Propose its own call) against the default, the streams: same tokens."""
    request = generation_pb2.GenerateRequest(
        prompt_token_ids=PROMPT, params=generation_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )

    async def main(step_calls: str) -> list[int]:
        async with in_process_coordinator(llama_workers, step_calls=step_calls) as (address, coordinator):
            tokens = (await generate(address, request)).token_ids
            stream = coordinator.workers.target.stream
            assert (stream is None) == (step_calls == "unary")
            return tokens

    outputs = [run_async(main(mode)) for mode in ("stream", "unary")]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12  # type: ignore[arg-type]


def test_a_caller_cancelled_leaves_the_replies_in_step_with_the_calls() -> None:
    async def main() -> None:
        async with _stream_to_fake_target() as (stream, fake):
            fake.streams_opened = 1  # (the fake answers every stream after its first)
            for step in (1, 2):
                cancelled = asyncio.ensure_future(stream.call(_decode(1, step * 10), 5))
                cancelled.cancel()  # a step loop stopped while its call was on the way
                reply = await stream.call(_decode(1, step * 10 + 1), 5)
                assert reply.results[0].seq_id == step * 10 + 1  # its own reply, not the cancelled call's
            assert stream.opened == 1

    run_async(main())


def test_closing_a_stream_fails_the_calls_still_waiting() -> None:
    async def main() -> None:
        async with _stream_to_fake_target() as (stream, _):
            waiting = asyncio.ensure_future(stream.call(_decode(1, 1), 60))  # on the first stream: never answered
            await asyncio.sleep(0.1)
            await stream.close()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await waiting
            assert error.value.code() == grpc.StatusCode.CANCELLED

    run_async(main())


def test_the_worker_is_told_of_each_reply_once_it_has_gone_out() -> None:
    """`serve_step_stream` hands `sent` each request after its reply is written, an answer or a failure, in order."""
    sent: list[int] = []

    async def handle(request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
        if request.step_id == 2:
            raise ValueError("a bad call")
        return _FakeTarget._reply(request)

    async def verify_stream(
        requests: AsyncIterator[target_pb2.VerifyStreamRequest], context: object
    ) -> AsyncIterator[target_pb2.VerifyStreamResponse]:
        told = lambda request: sent.append(request.step_id)  # noqa: E731
        async for reply in serve_step_stream(requests, handle, target_pb2.VerifyStreamResponse, told):
            yield reply

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.stream_stream_rpc_method_handler(
            verify_stream,
            request_deserializer=target_pb2.VerifyStreamRequest.FromString,  # type: ignore[arg-type]
            response_serializer=target_pb2.VerifyStreamResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"VerifyStream": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                stream = StepStream(stub.VerifyStream, target_pb2.VerifyStreamRequest)
                try:
                    calls = [stream.call(_decode(1, step), 10) for step in (1, 2, 3)]
                    assert sent == []  # nothing has gone out before the calls are read
                    results = await asyncio.gather(*calls, return_exceptions=True)
                    assert isinstance(results[1], grpc.aio.AioRpcError)
                    for _ in range(500):  # (the worker's side moves on once grpc has written the last reply)
                        if len(sent) == 3:
                            break
                        await asyncio.sleep(0.01)
                finally:
                    await stream.close()
        finally:
            await server.stop(None)

    run_async(main())
    assert sent == [1, 2, 3]


def test_work_left_for_after_a_reply_runs_once_it_went_out_or_before_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call's work left for after its reply (`ModelWorker.after_reply`, a proposal's upkeep) waits for the reply,
    runs on the compute thread before any later call's work, holds up no call that comes first, and runs after
    AFTER_REPLY_WAIT_S where no reply is reported."""
    worker = ModelWorker(WorkerOptions(str(TARGET_DIR), kv_cache_memory=0.01))
    done: list[str] = []

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(500):
            if condition():
                return
            await asyncio.sleep(0.01)

    async def main() -> None:
        monkeypatch.setattr(worker_module, "AFTER_REPLY_WAIT_S", 60.0)
        first, second = object(), object()
        await worker.run(worker.after_reply, first, lambda: done.append("first's upkeep"))
        await asyncio.sleep(0.2)
        assert done == []  # its reply is not out yet
        worker.replied(first)
        await until(lambda: bool(done))
        assert done == ["first's upkeep"]

        await worker.run(worker.after_reply, second, lambda: done.append("second's upkeep"))
        start = time.monotonic()
        await worker.run(done.append, "the next call")  # before the second's reply went out
        assert done[1:] == ["second's upkeep", "the next call"]
        assert time.monotonic() - start < 30  # it did not wait for the reply

        monkeypatch.setattr(worker_module, "AFTER_REPLY_WAIT_S", 0.05)
        await worker.run(worker.after_reply, object(), lambda: done.append("unreported upkeep"))
        await until(lambda: len(done) == 4)
        assert done[3:] == ["unreported upkeep"]

    run_async(main())
