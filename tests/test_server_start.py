"""A service freezes its start-up objects out of the garbage collector's way when it starts serving."""

from __future__ import annotations

import asyncio
import gc

from minedraft.rpc.server_utils import start_server


def test_start_up_objects_are_frozen() -> None:
    gc.unfreeze()

    async def start_and_count() -> int:
        server, port = await start_server(0, [], [], "127.0.0.1")
        try:
            assert port > 0
            return gc.get_freeze_count()
        finally:
            await server.stop(None)

    try:
        frozen = asyncio.run(start_and_count())
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert frozen > 10_000  # torch, grpc and their modules at least
