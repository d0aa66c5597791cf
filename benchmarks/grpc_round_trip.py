"""What a control message's round trip costs on this host: a unary grpc.aio call against a message on an open stream.

`python benchmarks/grpc_round_trip.py [--rounds 5] [--calls 300] [--bytes 600]`: an echo server in a child process
(grpc.aio, loopback TCP), and from this process, alternating in each round, `--calls` unary calls and as many
messages written and read back on one bidirectional stream, each `--bytes` long (a verify request of 64 sequences
is ~600 bytes). Prints each round's medians and their ratio. A step's worker calls are unary today; what one costs
outside the worker (`benchmarks/call_overhead.py`) is mostly this round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import grpc

SERVICE = "minedraft.bench.Echo"


def _same(message: bytes) -> bytes:
    return message


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _stream(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


async def serve() -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(_unary, _same, _same),
                    "Stream": grpc.stream_stream_rpc_method_handler(_stream, _same, _same),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def measure(port: int, rounds: int, calls: int, size: int) -> None:
    message = b"x" * size
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", _same, _same)
        stream = channel.stream_stream(f"/{SERVICE}/Stream", _same, _same)()

        async def one_unary() -> None:
            await unary(message)

        async def one_message() -> None:
            await stream.write(message)
            await stream.read()

        async def median_ms(call: object) -> float:
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                await call()  # type: ignore[operator]
                times.append(time.perf_counter() - start)
            return 1e3 * statistics.median(times)

        await median_ms(one_unary), await median_ms(one_message)  # warm-up
        for i in range(rounds):
            unary_ms, stream_ms = await median_ms(one_unary), await median_ms(one_message)
            print(
                f"round {i + 1}: unary call {unary_ms:.3f} ms, message on a stream {stream_ms:.3f} ms "
                f"({stream_ms / unary_ms:.2f}x)",
                flush=True,
            )
        await stream.done_writing()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="calls (and messages) per round")
    parser.add_argument("--bytes", type=int, default=600, help="each message's size")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve())
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        asyncio.run(measure(int(server.stdout.readline()), args.rounds, args.calls, args.bytes))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
