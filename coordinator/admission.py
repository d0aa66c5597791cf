"""Admission and preemption: who is prefilled, who waits for room in the workers' KV caches, who is preempted."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from coordinator.batch_manager import Batch, BatchManager
from coordinator.kv_blocks import PrefixMemory
from coordinator.request_state import RequestState
from coordinator.stream_outbox import StreamOutbox
from coordinator.workers import Workers

if TYPE_CHECKING:
    from minedraft.observability.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


class Admission:
    """The step loop's admission and preemption by the workers' free KV blocks (`Workers.free_blocks`, the
    ledgers' estimate): what a step admits and prefills on both workers (`admit`), what waits after a prefill found
    no room (`wait_for_room`), whom a step preempts (`make_room`), and what the target's prefix cache likely holds
    (`prefixes`)."""

    def __init__(
        self,
        workers: Workers,
        manager: BatchManager,
        k: int,
        outbox: StreamOutbox,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        """`k`: the most tokens a step drafts (the room each running sequence keeps for its next step); `outbox`:
        where the prefills' first tokens go (the step loop's)."""
        self.workers, self.manager, self.k, self.metrics = workers, manager, k, metrics
        self.outbox = outbox
        self.prefixes = PrefixMemory(workers.target.ledger)
        self.preemptions = 0
        self._order = itertools.count(1)
        # After a prefill found no room on the target: admit nothing until fewer than this many sequences run (0:
        # admit one request alone), `wait_for_room`
        self._room_awaited: int | None = None

    def admissions(self) -> list[RequestState]:
        """Pop what the batches and the workers' KV blocks have room for into the batches (`BatchManager.
        take_admissions`), in admission order; none while a prefill that found no room waits."""
        if self._room_awaited is not None and 0 < self._room_awaited <= self.manager.num_running:
            return []  # a prefill found no room: nothing is admitted until a running sequence leaves
        memory = self._memory_for(alone=self._room_awaited == 0)
        self._room_awaited = None
        admitted = [
            r for _, group in self.manager.take_admissions(memory, self.prefixes.admission_cost()) for r in group
        ]
        for request in admitted:
            request.admit(next(self._order))
        return admitted

    async def _prefill_in_turn(self, admitted: Sequence[RequestState]) -> tuple[Any, Any]:
        """The target's prefill, then the draft's with the target's states for it (a draft that reads them): the
        replies or errors, as `asyncio.gather` gives them (the draft's is None when the target's failed)."""
        try:
            target_reply = await self.workers.prefill_target(admitted)
        except Exception as exc:
            return exc, None
        states = target_reply.to_draft if target_reply.HasField("to_draft") else None
        try:
            await self.workers.prefill_draft(admitted, from_target=states)
        except Exception as exc:
            return target_reply, exc
        return target_reply, None

    async def admit(
        self,
        lose_target: Callable[[BaseException], bool],
        lose_draft: Callable[[BaseException], bool],
        fail: Callable[[Sequence[RequestState], BaseException], None],
    ) -> None:
        """Prefill what the batches and the workers' KV blocks have room for; a failed prefill's requests fail
        with it, or wait again (`wait_for_room`). `lose_target`, `lose_draft`: the step loop's,
        whether a call's error lost that worker; `fail`: ends requests with an error."""
        admitted = self.admissions()
        if not admitted:
            return
        workers = self.workers
        if workers.failover.draft_connected and workers.draft_reads_target:
            target_reply, draft_reply = await self._prefill_in_turn(admitted)
        else:
            drafting = workers.prefill_draft(admitted) if workers.failover.draft_connected else asyncio.sleep(0)
            target_reply, draft_reply = await asyncio.gather(
                workers.prefill_target(admitted), drafting, return_exceptions=True
            )
        if isinstance(target_reply, grpc.aio.AioRpcError) and _out_of_room(target_reply):
            if isinstance(draft_reply, BaseException) and not _out_of_room(draft_reply):
                lose_draft(draft_reply)  # (while the group is in the batches: what the draft may hold)
            if not self.wait_for_room(admitted, target_reply):
                fail(admitted, _no_room_alone(target_reply))
            return
        if isinstance(target_reply, BaseException):
            if not lose_target(target_reply):
                fail(admitted, target_reply)
            return
        if isinstance(draft_reply, BaseException) and not lose_draft(draft_reply):
            fail(admitted, draft_reply)
            return
        self.prefixes.prefilled(
            [r.prefill_ids for r in admitted], [r.cached_prompt_tokens for r in target_reply.results]
        )
        if len(target_reply.results) != len(admitted):
            raise RuntimeError(
                f"the prefill reply holds {len(target_reply.results)} results for {len(admitted)} sequences"
            )
        for request, result in zip(admitted, target_reply.results):
            request.prefilled(result.cached_prompt_tokens, result.prompt_logprobs)
            request.emit(list(result.token_ids), result.finish_reason, self.outbox, result.logprobs)
        if self.metrics is not None:
            new_prompts = sum(len(r.prompt_ids) for r in admitted if not r.decode.preemptions)
            self.metrics.prefilled(new_prompts, target_reply.results)

    def wait_for_room(self, group: list[RequestState], exc: grpc.aio.AioRpcError) -> bool:
        """The target had no room for the prefill of `group` (RESOURCE_EXHAUSTED: the KV blocks admission counted
        are an estimate): whether the group waits for it. Freed on both workers (a draft that took them holds
        them), it goes back to the front of the queue, as preempted requests do, and is admitted again once a
        running sequence has left, or, with none running, one request at a time. A request that found no room alone
        on an idle target never will: False, for it to fail."""
        running = self.manager.num_running - len(group)
        if not running and len(group) == 1:
            return False
        self.workers.release_later([r.seq_id for r in group])
        self.manager.requeue(group)
        self._room_awaited = running
        log.info(
            "no room on the target for a prefill of %d requests (%s): they wait for %s",
            len(group),
            exc.details(),
            f"one of the {running} running sequences to end" if running else "admission one at a time",
        )
        return True

    def _memory_for(self, alone: bool = False) -> Callable[[RequestState], bool]:
        """Whether the workers' free KV blocks (`Workers.free_blocks`) hold one more request's prompt, with a step's
        growth for it and every running sequence to spare; counting those said yes to (`alone`: yes to the first
        request only). With nothing running one is always admitted: a prompt within max_model_len fits an empty
        pool."""
        free = self.workers.free_blocks(self.k)
        running = self.manager.num_running
        first = running

        def memory(request: RequestState) -> bool:
            nonlocal running
            if alone and running > first:
                return False
            tokens = len(request.prefill_ids)
            needs = {w: self.workers.ledger(w).for_prompt(tokens) for w in free}
            if running and any(free[w][0] - needs[w] < (running + 1) * free[w][1] for w in free):
                return False
            running += 1
            for w in free:
                free[w] = (free[w][0] - needs[w], free[w][1])
            return True

        return memory

    def make_room(self, batch: Batch, k: int) -> None:
        """Before a step of k drafts on `batch`: while the workers' free KV blocks may not hold its growth, preempt
        its most recently admitted member (freed on both workers, queued first, prefilled again later with its
        output so far), so that no running request fails for lack of memory. Not a batch awaiting its verify: its
        room was made when it was drafted, and its verify may be in flight with every member."""
        if batch.awaiting_verify:
            return
        free = self.workers.free_blocks(k)
        preempted = []
        while batch.members and any(free[w][0] < len(batch.members) * free[w][1] for w in free):
            preempted.append(self.manager.preempt_latest(batch))
        if preempted:
            self.preemptions += len(preempted)
            if self.metrics is not None:
                self.metrics.preemptions.inc(len(preempted))
            log.info("KV cache full: %d sequences preempted, to be prefilled again", len(preempted))
            self.workers.release_later([r.seq_id for r in preempted])


def _out_of_room(exc: BaseException) -> bool:
    """Whether a worker refused a call for capacity (its KV blocks or rows: minedraft.errors.CapacityError)."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _no_room_alone(exc: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The error of a request that found no room on the target with nothing else running."""
    return grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        details=f"the target's KV cache cannot hold this request even with nothing else running ({exc.details()}): "
        "send a shorter prompt or a lower max_tokens, or give the target more KV cache (--kv-cache-memory, "
        "--gpu-memory-utilization)",
    )
