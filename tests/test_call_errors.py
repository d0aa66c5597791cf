"""Which worker errors lose the worker (`lost_reason`), and the statuses and reasons workers send for each error."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from coordinator.call_errors import lost_reason
from minedraft.errors import ChannelNotSetUpError, InternalError, InvalidRequest, LeaseError, ModelLoadError
from minedraft.proto import target_pb2, target_pb2_grpc
from minedraft.rpc.server_utils import REASON_KEY, grpc_errors
from minedraft.rpc.step_stream import StepStream, serve_step_stream

Code = grpc.StatusCode


def _error(code: grpc.StatusCode, details: str, reason: str | None = None) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((REASON_KEY, reason)) if reason is not None else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


@pytest.mark.parametrize(
    ("error", "lost"),
    [
        (_error(Code.UNAVAILABLE, "connection refused"), "unreachable: connection refused"),
        (_error(Code.DEADLINE_EXCEEDED, "Deadline Exceeded"), "deadline exceeded"),
        (_error(Code.FAILED_PRECONDITION, "coordinator b holds it", "lease"), "lease lost: coordinator b holds it"),
        (_error(Code.FAILED_PRECONDITION, "no channel set up yet", "channel"), "channel not set up (restarted)"),
        # An older worker sends no reason: its FAILED_PRECONDITIONs all meant a lost worker.
        (_error(Code.FAILED_PRECONDITION, "no channel set up yet"), "failed precondition: no channel set up yet"),
        (_error(Code.FAILED_PRECONDITION, "cannot load it", "model"), None),
        (_error(Code.INVALID_ARGUMENT, "batch_id must be 0 or 1"), None),
        (_error(Code.INTERNAL, "drafts of shape (2, 3) for 2 sequences, k=4"), None),
        (_error(Code.NOT_FOUND, "unknown sequence ids [7]"), None),
        (_error(Code.RESOURCE_EXHAUSTED, "need 4 KV blocks"), None),
        (ValueError("not a gRPC error"), None),
    ],
)
def test_lost_reason(error: BaseException, lost: str | None) -> None:
    assert lost_reason(error) == lost


RAISED: dict[str, BaseException] = {
    "lease": LeaseError("coordinator b holds this worker's lease"),
    "channel": ChannelNotSetUpError("no channel set up yet"),
    "model": ModelLoadError("model directory '/x' does not exist"),
    "invalid": InvalidRequest("batch_id must be 0 or 1"),
    "value": ValueError("an invariant of ours broke"),
    "internal": InternalError("drafts of shape (2, 3) for 2 sequences, k=4"),
}
# name: (the status a caller gets, the reason in its trailing metadata, whether it loses the worker)
EXPECTED: dict[str, tuple[grpc.StatusCode, str | None, bool]] = {
    "lease": (Code.FAILED_PRECONDITION, "lease", True),
    "channel": (Code.FAILED_PRECONDITION, "channel", True),
    "model": (Code.FAILED_PRECONDITION, "model", False),
    "invalid": (Code.INVALID_ARGUMENT, None, False),
    "value": (Code.INTERNAL, None, False),
    "internal": (Code.INTERNAL, None, False),
}


class _Failing:
    """A unary handler and a step stream that raise the error their request names (RAISED)."""

    @grpc_errors
    async def Fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RAISED[request.decode()]

    async def VerifyStream(
        self, requests: AsyncIterator[target_pb2.VerifyStreamRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[target_pb2.VerifyStreamResponse]:
        async def handle(request: target_pb2.VerifyRequest) -> target_pb2.VerifyResponse:
            raise RAISED[list(RAISED)[request.step_id]]

        async for reply in serve_step_stream(requests, handle, target_pb2.VerifyStreamResponse):
            yield reply


def _reason(error: grpc.aio.AioRpcError) -> str | None:
    return next((str(v) for k, v in error.trailing_metadata() or () if k == REASON_KEY), None)


def test_workers_send_each_errors_status_and_reason_on_unary_calls_and_step_streams() -> None:
    """On a loopback server: a unary call and a call on a step stream end alike, the reason in trailing metadata."""

    async def main() -> dict[str, list[grpc.aio.AioRpcError]]:
        failing = _Failing()
        server = grpc.aio.server()
        stream_handler = grpc.stream_stream_rpc_method_handler(
            failing.VerifyStream,
            request_deserializer=target_pb2.VerifyStreamRequest.FromString,  # type: ignore[arg-type]
            response_serializer=target_pb2.VerifyStreamResponse.SerializeToString,
        )
        handlers: dict[str, Any] = {
            "Fail": grpc.unary_unary_rpc_method_handler(failing.Fail),
            "VerifyStream": stream_handler,
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("minedraft.v1.TargetService", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        errors: dict[str, list[grpc.aio.AioRpcError]] = {name: [] for name in RAISED}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                fail: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    "/minedraft.v1.TargetService/Fail"
                )
                stub = target_pb2_grpc.TargetServiceStub(channel)
                stream = StepStream(stub.VerifyStream, target_pb2.VerifyStreamRequest)
                try:
                    for step_id, name in enumerate(RAISED):
                        unary = fail(name.encode(), timeout=10)
                        streamed = stream.call(target_pb2.VerifyRequest(step_id=step_id), 10)
                        for call in (unary, streamed):
                            with pytest.raises(grpc.aio.AioRpcError) as caught:
                                await call
                            errors[name].append(caught.value)
                    assert stream.opened == 1  # every failed call left the stream open
                finally:
                    await stream.close()
        finally:
            await server.stop(None)
        return errors

    for name, (unary, streamed) in asyncio.run(main()).items():
        code, reason, lost = EXPECTED[name]
        for error in (unary, streamed):
            assert (error.code(), _reason(error)) == (code, reason), (name, error)
            assert error.details() == str(RAISED[name])
            assert (lost_reason(error) is not None) == lost, (name, lost_reason(error))
