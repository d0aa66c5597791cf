"""Scripted fake target and draft services at the stub level, and the real coordinator's step loop wired to them with
no gRPC server (the vLLM scheduler-test pattern): its policies tested on the CPU, in milliseconds.

The fake target "model" emits `token_at(seq_id, position)` at every position; prompts are made of it too, so a
worker can check every token it is given. The fake draft proposes the same tokens (every n-th one wrong, on
request). Both count KV blocks as a paged cache would, log every call, and fail or hang calls on demand."""

from __future__ import annotations

import asyncio
import itertools
import struct
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from coordinator.batch_manager import BatchManager
from coordinator.pairing import Layout
from coordinator.request_state import RequestState
from coordinator.step_loop import StepLoop
from coordinator.stream_outbox import StreamOutbox
from coordinator.workers import Workers
from minedraft.engine.sampling import SamplingConfig
from minedraft.proto import common_pb2, draft_pb2, generation_pb2, target_pb2
from minedraft.rpc.server_utils import REASON_KEY

VOCAB = 32000
FINISH = generation_pb2
R = TypeVar("R")


def token_at(seq_id: int, position: int) -> int:
    """The fake model: the token at `position` (0: the prompt's first) of sequence `seq_id`."""
    return (seq_id * 7919 + position * 104729 + 17) % VOCAB


def prompt(seq_id: int, length: int) -> list[int]:
    """A prompt the fake model would have written itself, so that a worker can check every token it is given."""
    return [token_at(seq_id, i) for i in range(length)]


def expected(request: RequestState) -> list[int]:
    """What the fake target emits for `request`, greedy and alone."""
    start = len(request.prompt_ids)
    return [token_at(request.seq_id, start + i) for i in range(request.config.max_tokens)]


def rpc_error(code: grpc.StatusCode, details: str = "", reason: str | None = None) -> grpc.aio.AioRpcError:
    """A call's error as grpc.aio raises it; `reason`: a FAILED_PRECONDITION's trailing "minedraft-reason"."""
    trailing = grpc.aio.Metadata((REASON_KEY, reason)) if reason else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details or f"fake {code.name}")


@dataclass
class Call:
    """One call to a fake: `start` and `end` are ticks of the log's clock, shared by both fakes, so that the order of
    calls and whether two were in flight together can be read off."""

    worker: str
    method: str
    request: Any
    start: int
    end: int = -1
    error: grpc.StatusCode | None = None

    def overlaps(self, other: Call) -> bool:
        return self.start < other.end and other.start < self.end


class CallLog:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._clock = itertools.count()

    def tick(self) -> int:
        return next(self._clock)

    def of(self, worker: str | None = None, method: str | None = None) -> list[Call]:
        return [c for c in self.calls if worker in (None, c.worker) and method in (None, c.method)]


@dataclass
class Fault:
    """What the next calls of one method do: `skip` answer first, then `times` fail with `code` (None: hang until
    their timeout, then DEADLINE_EXCEEDED)."""

    code: grpc.StatusCode | None
    reason: str | None = None
    times: int = 1
    skip: int = 0


@dataclass
class Held:
    """One sequence on a fake worker: `length` tokens known (prompt and output), `cached` of them in its KV cache."""

    length: int
    cached: int
    max_tokens: int = 0
    generated: int = 0
    proposed: list[int] = field(default_factory=list)  # (the draft) its last proposal's drafts


class FakeWorker:
    """What both fakes share: sequences, KV blocks, the lease, the call log and scripted faults."""

    name = ""

    def __init__(self, log: CallLog, block_size: int = 4, num_blocks: int = 4096, latency: float = 0.0) -> None:
        """`latency`: seconds each call takes (0: it still yields once, as a call over a network would)."""
        self.log, self.block_size, self.num_blocks, self.latency = log, block_size, num_blocks, latency
        self.sequences: dict[int, Held] = {}
        self.faults: dict[str, Fault] = {}
        self.down = False  # every call UNAVAILABLE: the process is gone
        self.epoch = 0
        self.problems: list[str] = []  # what the coordinator sent that a real worker would get wrong

    # ----------------------------------------------------------------------------------------------- scripting

    def fail(
        self, method: str, code: grpc.StatusCode, *, reason: str | None = None, times: int = 1, skip: int = 0
    ) -> None:
        self.faults[method] = Fault(code, reason, times, skip)

    def hang(self, method: str, *, times: int = 1, skip: int = 0) -> None:
        self.faults[method] = Fault(None, None, times, skip)

    # ----------------------------------------------------------------------------------------------- state

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size) if self.block_size else 0

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - sum(self.blocks(s.cached) for s in self.sequences.values())

    def info(self) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(
            model=f"fake-{self.name}",
            device="cpu",
            host_id="fake-host",
            num_slots=256,
            max_model_len=4096,
            logits_size=VOCAB,
            tokenizer_size=VOCAB,
            tokenizer_hash="fake",
            channels=["grpc"],
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            free_blocks=self.free_blocks,
        )

    def _release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.sequences.pop(seq_id, None)

    def _sequence(self, seq_id: int) -> Held:
        if seq_id not in self.sequences:
            raise rpc_error(grpc.StatusCode.NOT_FOUND, f"sequence {seq_id} is not on the {self.name}")
        return self.sequences[seq_id]

    def _admit(self, specs: Sequence[common_pb2.SequenceSpec]) -> None:
        """Prefill `specs` (all or none), each checked token by token against the model."""
        for spec in specs:
            if spec.seq_id in self.sequences:
                raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"sequence {spec.seq_id} is live already")
            if list(spec.prompt_token_ids) != prompt(spec.seq_id, len(spec.prompt_token_ids)):
                self.problems.append(f"{self.name} prefill of {spec.seq_id}: tokens not the model's")
        if sum(self.blocks(len(s.prompt_token_ids)) for s in specs) > self.free_blocks:
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no KV blocks on the {self.name}")
        for spec in specs:
            tokens = len(spec.prompt_token_ids)
            self.sequences[spec.seq_id] = Held(tokens, tokens, spec.params.max_tokens)

    async def _call(self, method: str, request: Any, timeout: float | None, answer: Callable[[], R]) -> R:
        """Log the call, take `latency`, then fail as scripted or answer."""
        call = Call(self.name, method, request, self.log.tick())
        self.log.calls.append(call)
        try:
            await asyncio.sleep(self.latency)
            fault = self.faults.get(method)
            if self.down:
                raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the {self.name} is down")
            if fault is not None and fault.skip:
                fault.skip -= 1
            elif fault is not None:
                fault.times -= 1
                if not fault.times:
                    del self.faults[method]
                if fault.code is not None:
                    raise rpc_error(fault.code, reason=fault.reason)
                if timeout is None:
                    await asyncio.Event().wait()  # hung for good
                await asyncio.sleep(timeout or 0.0)
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return answer()
        except grpc.aio.AioRpcError as exc:
            call.error = exc.code()
            raise
        finally:
            call.end = self.log.tick()

    def _lease(self, request: Any) -> common_pb2.Lease:
        """A new lease frees what the last one held (a renewal or a give-up of the current one keeps it)."""
        if request.give_up:
            self.sequences.clear()
            return common_pb2.Lease()
        if request.epoch != self.epoch or not request.epoch:
            self.epoch += 1
            self.sequences.clear()
        return common_pb2.Lease(owner=request.owner, epoch=self.epoch, ttl_s=30.0)


class FakeTarget(FakeWorker):
    """The target: emits `token_at`, accepts a draft while it equals it, finishes at max_tokens."""

    name = "target"

    async def GetInfo(self, request: Any, timeout: float | None = None) -> target_pb2.TargetServiceGetInfoResponse:
        return await self._call(
            "GetInfo", request, timeout, lambda: target_pb2.TargetServiceGetInfoResponse(info=self.info())
        )

    async def Lease(self, request: Any, timeout: float | None = None) -> target_pb2.TargetServiceLeaseResponse:
        return await self._call(
            "Lease", request, timeout, lambda: target_pb2.TargetServiceLeaseResponse(lease=self._lease(request))
        )

    async def Prepare(self, request: Any, timeout: float | None = None) -> target_pb2.TargetServicePrepareResponse:
        return await self._call("Prepare", request, timeout, target_pb2.TargetServicePrepareResponse)

    async def SetupChannel(
        self, request: Any, timeout: float | None = None
    ) -> target_pb2.TargetServiceSetupChannelResponse:
        return await self._call("SetupChannel", request, timeout, target_pb2.TargetServiceSetupChannelResponse)

    async def Release(self, request: Any, timeout: float | None = None) -> target_pb2.TargetServiceReleaseResponse:
        def answer() -> target_pb2.TargetServiceReleaseResponse:
            self._release(request.seq_ids)
            return target_pb2.TargetServiceReleaseResponse(free_blocks=self.free_blocks)

        return await self._call("Release", request, timeout, answer)

    async def Prefill(self, request: Any, timeout: float | None = None) -> target_pb2.TargetServicePrefillResponse:
        def answer() -> target_pb2.TargetServicePrefillResponse:
            self._release(request.release_seq_ids)
            self._admit(request.sequences)
            results = [self._emit(s.seq_id, [], 0) for s in request.sequences]
            return target_pb2.TargetServicePrefillResponse(results=results, free_blocks=self.free_blocks)

        return await self._call("Prefill", request, timeout, answer)

    async def Verify(self, request: Any, timeout: float | None = None) -> target_pb2.VerifyResponse:
        def answer() -> target_pb2.VerifyResponse:
            self._release(request.release_seq_ids)
            k, rows = request.num_draft_tokens, len(request.seq_ids)
            sequences = [self._sequence(s) for s in request.seq_ids]
            if k and (request.drafts.batch_size != rows or request.drafts.num_tokens != k):
                self.problems.append(f"verify of step {request.step_id} given drafts of another shape")
            drafts = struct.unpack(f"<{rows * k}i", request.drafts.token_ids) if k else ()
            # The step writes the last token and the k drafts of each row before it rolls back what it rejects.
            if sum(self.blocks(s.cached + k + 1) - self.blocks(s.cached) for s in sequences) > self.free_blocks:
                raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV blocks for the verify")
            results = [self._emit(s, drafts[row * k : (row + 1) * k], k) for row, s in enumerate(request.seq_ids)]
            return target_pb2.VerifyResponse(results=results, free_blocks=self.free_blocks)

        return await self._call("Verify", request, timeout, answer)

    def _emit(self, seq_id: int, drafts: Sequence[int], k: int) -> target_pb2.SequenceResult:
        """The accepted drafts and the target's own next token, cut at max_tokens."""
        seq = self.sequences[seq_id]
        if seq.generated >= seq.max_tokens:
            self.problems.append(f"sequence {seq_id} stepped after it finished")
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == token_at(seq_id, seq.length + accepted):
            accepted += 1
        tokens = [token_at(seq_id, seq.length + i) for i in range(accepted + 1)][: seq.max_tokens - seq.generated]
        seq.length += len(tokens)
        seq.cached = seq.length - 1  # the last token is written by the next step
        seq.generated += len(tokens)
        finish = FINISH.FINISH_REASON_LENGTH if seq.generated >= seq.max_tokens else FINISH.FINISH_REASON_UNSPECIFIED
        return target_pb2.SequenceResult(
            seq_id=seq_id,
            token_ids=tokens,
            num_accepted=accepted,
            finish_reason=finish,  # type: ignore[arg-type]
        )


class FakeDraft(FakeWorker):
    """The draft: proposes `token_at`, every `wrong_every`-th draft token wrong (0: none), after checking that the
    tokens it is fed (the verdict, missed tokens, the next token) are the model's at the positions it holds."""

    name = "draft"

    def __init__(self, log: CallLog, wrong_every: int = 0, **worker: Any) -> None:
        super().__init__(log, **worker)
        self.wrong_every = wrong_every
        self._drafted = itertools.count(1)

    async def GetInfo(self, request: Any, timeout: float | None = None) -> draft_pb2.DraftServiceGetInfoResponse:
        return await self._call(
            "GetInfo", request, timeout, lambda: draft_pb2.DraftServiceGetInfoResponse(info=self.info())
        )

    async def Lease(self, request: Any, timeout: float | None = None) -> draft_pb2.DraftServiceLeaseResponse:
        return await self._call(
            "Lease", request, timeout, lambda: draft_pb2.DraftServiceLeaseResponse(lease=self._lease(request))
        )

    async def Prepare(self, request: Any, timeout: float | None = None) -> draft_pb2.DraftServicePrepareResponse:
        return await self._call("Prepare", request, timeout, draft_pb2.DraftServicePrepareResponse)

    async def SetupChannel(
        self, request: Any, timeout: float | None = None
    ) -> draft_pb2.DraftServiceSetupChannelResponse:
        return await self._call("SetupChannel", request, timeout, draft_pb2.DraftServiceSetupChannelResponse)

    async def Release(self, request: Any, timeout: float | None = None) -> draft_pb2.DraftServiceReleaseResponse:
        def answer() -> draft_pb2.DraftServiceReleaseResponse:
            self._release(request.seq_ids)
            return draft_pb2.DraftServiceReleaseResponse(free_blocks=self.free_blocks)

        return await self._call("Release", request, timeout, answer)

    async def Prefill(self, request: Any, timeout: float | None = None) -> draft_pb2.DraftServicePrefillResponse:
        def answer() -> draft_pb2.DraftServicePrefillResponse:
            self._release(request.release_seq_ids)
            self._admit(request.sequences)
            return draft_pb2.DraftServicePrefillResponse(free_blocks=self.free_blocks)

        return await self._call("Prefill", request, timeout, answer)

    async def Propose(self, request: Any, timeout: float | None = None) -> draft_pb2.ProposeResponse:
        def answer() -> draft_pb2.ProposeResponse:
            self._release(request.release_seq_ids)
            k = request.num_draft_tokens
            missed = iter(request.missed_token_ids)
            rows: list[int] = []
            for i, seq_id in enumerate(request.seq_ids):
                seq = self._sequence(seq_id)
                accepted = min(request.num_accepted[i], len(seq.proposed))  # (as the real draft: none after a prefill)
                if seq.proposed[:accepted] != [token_at(seq_id, seq.length + j) for j in range(accepted)]:
                    self.problems.append(f"draft of {seq_id}: a verdict of {accepted} its drafts do not bear")
                seq.length += accepted
                num_missed = request.num_missed_tokens[i] if request.num_missed_tokens else 0
                for token in [*itertools.islice(missed, num_missed), request.next_token_ids[i]]:
                    if token != token_at(seq_id, seq.length):
                        self.problems.append(f"draft of {seq_id}: fed {token} at {seq.length}, not the model's")
                    seq.length += 1
                seq.proposed = [self._draft(token_at(seq_id, seq.length + j)) for j in range(k)]
                seq.cached = seq.length - 1 + k
                rows += seq.proposed
            drafts = common_pb2.DraftPayload(
                channel="grpc",
                step_id=request.step_id,
                batch_size=len(request.seq_ids),
                num_tokens=k,
                token_ids=struct.pack(f"<{len(rows)}i", *rows),
            )
            return draft_pb2.ProposeResponse(drafts=drafts, free_blocks=self.free_blocks)

        return await self._call("Propose", request, timeout, answer)

    def _draft(self, token: int) -> int:
        wrong = self.wrong_every and next(self._drafted) % self.wrong_every == 0
        return (token + 1) % VOCAB if wrong else token


@dataclass
class Received:
    """What a request's client got: the tokens, and how its stream ended (a finish reason, or an error)."""

    tokens: list[int]
    finish_reason: int
    error: BaseException | None
    usage: generation_pb2.Usage | None


class Harness:
    """The real `Workers`, `BatchManager`, `StepLoop` and `StreamOutbox`, as `Coordinator` wires them, around a
    `FakeTarget` and a `FakeDraft` (none in ar)."""

    def __init__(self, workers: Workers, manager: BatchManager, loop: StepLoop, log: CallLog) -> None:
        self.workers, self.manager, self.loop, self.log = workers, manager, loop, log
        self.target: FakeTarget = workers.target.stub
        self.draft: FakeDraft = workers.draft.stub  # (None in ar)
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(
        cls,
        mode: str = "psd",
        k: int = 3,
        *,
        max_batch_size: int = 8,
        max_prefill_tokens: int = 0,
        overlap: str = "auto",
        speculation: str = "always",
        target: dict[str, Any] | None = None,
        draft: dict[str, Any] | None = None,
        draft_timeout: float = 30.0,
        retry_interval: float = 0.0,
        channel_setup_timeout: float = 60.0,
        **loop_options: Any,
    ) -> Harness:
        """`target`, `draft`: the fakes' keyword arguments (`FakeWorker`, `FakeDraft`); `loop_options`: the
        `StepLoop`'s other keyword arguments."""
        log = CallLog()
        fakes = (FakeTarget(log, **(target or {})), FakeDraft(log, **(draft or {})) if mode != "ar" else None)
        wake, outbox = asyncio.Event(), StreamOutbox()
        workers = Workers(
            "fake-target:1",
            "fake-draft:1" if mode != "ar" else None,
            step_streams=False,
            draft_timeout=draft_timeout,
            retry_interval=retry_interval,
            channel_setup_timeout=channel_setup_timeout,
            call_started=outbox.call_started,
            wake=wake,
            stubs=fakes,
        )
        manager = BatchManager(max_batch_size, 64, 2 if mode == "psd" else 1, max_prefill_tokens)
        loop = StepLoop(
            workers,
            manager,
            mode,
            k,
            outbox=outbox,
            wake=wake,
            overlap=overlap,
            speculation=speculation,
            **loop_options,
        )
        await workers.pair.connect()
        await workers.pair.set_up(Layout(max_batch_size, len(manager.batches), k, loop.draft_lengths))
        workers.failover.reset_ledgers()
        return cls(workers, manager, loop, log)

    def submit(self, seq_id: int, prompt_len: int = 8, max_tokens: int = 16, *, seeded: bool = False) -> RequestState:
        config = SamplingConfig(max_tokens=max_tokens, seed=seq_id if seeded else 0)
        request = RequestState(seq_id, prompt(seq_id, prompt_len), config, (), None, seeded=seeded)
        self.manager.submit(request)
        self.loop.wake()
        return request

    async def step_until(self, done: Callable[[], bool], max_steps: int = 2000) -> int:
        """Step the loop until `done` (a background probe of the draft runs as the fakes' calls yield); the steps."""
        for steps in range(max_steps):
            if done():
                return steps
            if self.loop.has_work():
                await self.loop.step()
            else:
                await asyncio.sleep(0.001)
        raise AssertionError(f"not done in {max_steps} steps")

    async def finish(self, requests: Sequence[RequestState]) -> int:
        return await self.step_until(lambda: all(r.finished for r in requests))

    def run_loop(self) -> None:
        """`StepLoop.run` in a task, as the coordinator runs it."""
        self._task = asyncio.create_task(self.loop.run())

    async def until(self, done: Callable[[], bool], timeout: float = 3.0) -> None:
        """Wait while the loop runs until `done`."""
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, "not done in time"
            assert self._task is None or not self._task.done(), "the step loop ended"
            await asyncio.sleep(0.001)

    def received(self, request: RequestState) -> Received:
        """Everything on the request's client queue by now."""
        self.loop.outbox.flush()
        tokens: list[int] = []
        finish: int = FINISH.FINISH_REASON_UNSPECIFIED
        error: BaseException | None = None
        usage: generation_pb2.Usage | None = None
        queue = request.client.queue
        while not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                error = item
                continue
            tokens += item.token_ids
            finish = item.finish_reason
            if item.HasField("usage"):
                usage = item.usage
        return Received(tokens, finish, error, usage)

    def problems(self) -> list[str]:
        fakes: list[FakeWorker] = [self.target] + ([self.draft] if self.draft is not None else [])
        return [p for fake in fakes for p in fake.problems]

    async def close(self) -> None:
        """Stop the loop as the coordinator does."""
        if self._task is not None:
            self.loop.stop()
            await self._task
        await self.loop.shutdown()
        await self.workers.close()


def run(test: Callable[[Harness], Coroutine[Any, Any, None]], timeout: float = 5.0, **harness: Any) -> None:
    """Run `test` on a fresh `Harness(**harness)`, closed after; a test that outlives `timeout` fails."""

    async def main() -> None:
        h = await Harness.start(**harness)
        try:
            await asyncio.wait_for(test(h), timeout)
        finally:
            await asyncio.wait_for(h.close(), 1.0)
        assert not h.problems(), h.problems()

    asyncio.run(main())
