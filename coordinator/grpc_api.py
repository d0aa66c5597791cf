"""The public gRPC API, `minedraft.v1.GenerationService`, over the front door."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from coordinator.front_door import FrontDoor, RequestRefused
from minedraft.proto import generation_pb2, generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServiceServicer):
    """`Generate` streams a request through the front door; `GetServerInfo` says what this coordinator serves."""

    def __init__(self, front_door: FrontDoor) -> None:
        self.front_door = front_door

    async def GetServerInfo(
        self, request: generation_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> generation_pb2.GetServerInfoResponse:
        front = self.front_door
        pair = front.workers.pair
        return generation_pb2.GetServerInfoResponse(
            target_model=pair.target_info.model,
            draft_model=pair.draft_info.model,
            mode=front.loop.mode,
            channel=pair.channel,
            num_speculative_tokens=front.loop.k,
            max_batch_size=front.manager.max_batch_size,
            max_queue_size=front.options.max_queue_size,
            max_model_len=front.context_length,  # what a request may hold, as its errors say
            vocab_size=pair.target_info.logits_size,
        )

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        front = self.front_door
        try:
            generation = await front.admit(request, context.invocation_metadata())
        except RequestRefused as exc:
            await context.abort(exc.code, exc.message)
        try:
            async for message in front.responses(generation):
                yield message
        except RequestRefused as exc:
            await context.abort(exc.code, exc.message)
        finally:
            front.close(generation)
