"""The coordinator's step loop: batch-parallel speculative decoding (psd), its sequential baseline (sd), and ar."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING

import grpc

from coordinator.admission import Admission
from coordinator.batch_manager import Batch, BatchManager
from coordinator.overlap_policy import OverlapPolicy
from coordinator.request_state import FINISH, RequestState
from coordinator.speculation_policy import SpeculationPolicy, draft_lengths
from coordinator.stream_outbox import StreamOutbox
from coordinator.tetris_policy import ExtraProposals, checked_budget, prepared_lengths
from coordinator.workers import Workers
from minedraft.proto import target_pb2

if TYPE_CHECKING:
    from minedraft.observability.metrics import CoordinatorMetrics

log = logging.getLogger(__name__)


class Unavailable(Exception):
    """Ends a request's stream with UNAVAILABLE: the coordinator stopped, or lost the target, before it finished;
    the client may send it again."""


TARGET_LOST = "the target service became unreachable or restarted before this request finished: send it again"
MODES = ("psd", "sd", "ar")


class StepLoop:
    """Each step: admit and prefill waiting requests; then, in psd, Verify(batch X) and Propose(batch Y) run at
    once on the two workers. With one batch empty, or in sd mode (a single batch), Propose and Verify run one
    after the other on the same batch; in ar mode the target decodes alone (Verify with no drafts).

    It calls the workers through `workers`, reports what its calls raised to `workers.failover` and asks it once
    before each step what the workers can do (`Failover.before_step`); it waits on `wake` for new work, a stop, or
    news from the workers."""

    def __init__(
        self,
        workers: Workers,
        manager: BatchManager,
        mode: str,
        k: int,
        *,
        outbox: StreamOutbox,
        wake: asyncio.Event,
        metrics: CoordinatorMetrics | None = None,
        overlap: str = "auto",
        speculation: str = "auto",
        min_k: int = 0,
        tetris: bool = False,
        extra_proposals: str = "2",
        verify_token_budget: int = 0,
    ) -> None:
        """`outbox`: where what a step emits waits until the next worker calls are sent (the one `workers` tells
        of its calls). `min_k`: the fewest tokens a step drafts under `speculation` auto (0: k, or none).
        `tetris`: each step drafts `extra_proposals` more tokens a row and verifies `verify_token_budget` of the
        batch's drafts (0: k a row), those the draft finds likeliest (design section 14)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        self.workers, self.manager, self.mode = workers, manager, mode
        self.failover = workers.failover
        self.k = 0 if mode == "ar" else k
        self.metrics = metrics
        self.overlap_policy = OverlapPolicy(overlap)
        # The draft lengths steps may take (each precaptured on the workers), the longest first.
        self.draft_lengths = (
            () if self.k == 0 else draft_lengths(self.k, min_k or self.k) if speculation == "auto" else (self.k,)
        )
        self.speculation_policy = SpeculationPolicy(speculation, self.draft_lengths)
        self.tetris = tetris and self.k > 0
        self.extra_proposals = ExtraProposals(extra_proposals) if self.tetris else None
        self.verify_token_budget = checked_budget(verify_token_budget)
        self.prepared_lengths = prepared_lengths(self.draft_lengths, self.extra_proposals)
        self.outbox = outbox
        self._fail_requests = functools.partial(fail_requests, outbox)
        self._step_ids = itertools.count()
        self._wake = wake
        self._stopping = False
        # Verify calls sent ahead (`_send_verify_ahead`), by batch id
        self._verifying: dict[int, asyncio.Task[target_pb2.VerifyResponse]] = {}
        self.admission = Admission(workers, manager, max(self.prepared_lengths, default=self.k), outbox, metrics)

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def has_work(self) -> bool:
        return bool(self.manager.waiting) or any(b.members or b.joining for b in self.manager.batches)

    async def run(self) -> None:
        while not self._stopping:
            if self.failover.target_lost:
                await self._reconnect_target()
                continue
            if not self.has_work():
                self._wake.clear()  # before any await: a wake (new work, stop) meanwhile must not be lost
                await self._flush_releases(always=True)  # nothing else goes to the workers now
                self.outbox.flush()
                if not self.failover.target_lost:  # (found lost by those releases: reconnect at once)
                    await self._wake.wait()
                continue
            try:
                await self.step()
            except Exception as exc:  # a fault of ours: its batches fail whole (INTERNAL), never the loop
                log.exception("step failed: failing the requests in the batches")
                fail_requests(
                    self.outbox, self.manager.held(), RuntimeError(f"internal error in the coordinator's step: {exc!r}")
                )
                await self._drop_batches()

    async def step(self) -> None:
        attributes = {
            "minedraft.mode": self.mode,
            "minedraft.queue_length": self.manager.queue_length,
            "minedraft.running": self.manager.num_running,
        }
        with self.workers.tracing.step(attributes):
            await self._step()

    async def _step(self) -> None:
        waiting = any(b.awaiting_verify for b in self.manager.batches)
        draft_back = self.failover.before_step(self.manager.admitted_ids(), waiting)
        await self._remove_finished()
        if draft_back and not any(b.awaiting_verify for b in self.manager.batches):
            # (else at a later step: the running requests are handed over with no drafts waiting for a verify)
            await self.failover.hand_over_draft(self.manager.running(), self._prefill_draft_again)
        await self.admission.admit(self._lose_target, self._lose_draft, self._fail_requests)
        await self._remove_finished()  # a failed prefill's requests, and those its first token ended, leave now
        if self.failover.target_lost:
            return
        batches = self.manager.batches
        to_verify = next((b for b in batches if b.awaiting_verify), None)
        to_propose = next((b for b in batches if b.members and not b.awaiting_verify), None)
        drafting = self.mode != "ar" and self.failover.draft_connected
        sequences = max(sum(len(b.members) for b in batches), 1)  # (none, after a failed admission)
        policy = self.speculation_policy.at(sequences)
        start = time.perf_counter()
        k = self.speculation_policy.choose(sequences) if drafting else 0
        # A sampled token depends on whether its position was drafted, and how long the draft was: while a request
        # sampled with its client's seed runs, every step drafts k, so that its output is the seed's whatever the
        # policy measures.
        if drafting and any(r.request.seeded for b in batches for r in b.members):
            k = self.k
        if not k:
            emitted = 0
            for batch in batches:
                self.admission.make_room(batch, 0)
                if batch.members:
                    emitted += await self._verify(batch)
            if drafting and to_verify is None:  # (a step that verified drafts is not the target's alone)
                policy.record(0, time.perf_counter() - start, emitted / sequences)
        elif to_verify is not None and to_propose is not None:
            verified, verified_k = len(to_verify.members), to_verify.policy_drafts
            overlap = self.overlap_policy.choose()
            if overlap:
                emitted, _ = await _together(self._verify(to_verify), self._propose(to_propose, k))
            else:
                emitted = await self._verify(to_verify)
                await self._propose(to_propose, k)
            self.overlap_policy.record(overlap, time.perf_counter() - start, verified)
            # (the tokens, and most of the step, are the verified batch's, drafted a step before)
            policy.record(verified_k, time.perf_counter() - start, emitted / sequences)
            if self.metrics is not None and overlap:
                self.metrics.overlapped_step(start, time.perf_counter())
        elif to_verify is not None:
            await self._verify(to_verify)
        elif to_propose is not None:
            await self._propose(to_propose, k)
            other_has_work = any(b.members for b in batches if b is not to_propose)
            if not other_has_work:  # fallback: standard SD on the only batch with work
                emitted = await self._verify(to_propose)
                policy.record(k, time.perf_counter() - start, emitted / sequences)

    @property
    def drafting(self) -> bool:
        """Whether steps draft (the speculation policy's preference, a trial aside)."""
        return self.mode != "ar" and self.failover.draft_connected and self.speculation_policy.current.preferred > 0

    @property
    def draft_length(self) -> int:
        """Tokens a step drafts (the speculation policy's length, a trial aside; 0: the target alone)."""
        return self.speculation_policy.current.preferred if self.drafting else 0

    async def _remove_finished(self) -> None:
        await self._release(
            [r for b in self.manager.batches if not b.awaiting_verify for r in self.manager.remove_finished(b)]
        )

    async def _propose(self, batch: Batch, k: int) -> None:
        """k drafts a row of `batch` (TETRIS: k plus the extra drafts, of which the budget's are verified)."""
        extras = self.extra_proposals
        if extras is not None and any(r.request.seeded for r in batch.members):
            extras = None  # (a seeded request's output must not depend on what else its batch holds: `_step`)
        drafts = k + extras.choose(k, hidden=self.mode == "psd" and not self.overlap_policy.never) if extras else k
        self.admission.make_room(batch, drafts)
        if not batch.members:
            return
        budget = (self.verify_token_budget or k * len(batch.members)) if extras is not None else 0
        batch.begin_propose()
        try:
            reply = await self.workers.propose(next(self._step_ids), batch.batch_id, batch.members, drafts, budget)
        except Exception as exc:
            if not self._lose_draft(exc):
                fail_requests(self.outbox, batch.members, exc)
            batch.propose_failed()
            return
        if extras is not None:
            extras.record_propose(reply.timings.compute_s, drafts)
        batch.drafted(reply.drafts, drafts, k)
        self._send_verify_ahead(batch)

    def _send_verify_ahead(self, batch: Batch) -> None:
        """PSD's pipelining: the verify of a batch whose drafts just came back is sent now, so that the target
        starts on it the moment it is done with the other batch's (a call's round trip, ~1.5 ms on two H200s, would
        leave it idle every step); the step that verifies the batch awaits it (`_verify`). Not while requests wait:
        their prefill would queue behind this verify, and the step that admits them would wait for it."""
        if not self.manager.waiting:
            self._verifying[batch.batch_id] = asyncio.ensure_future(self._call_verify(batch))

    def _call_verify(self, batch: Batch) -> Awaitable[target_pb2.VerifyResponse]:
        return self.workers.verify(
            next(self._step_ids), batch.batch_id, batch.members, batch.drafts, batch.drafts_to_verify
        )

    async def _verify(self, batch: Batch) -> int:
        """Verify the batch's drafts (a plain decode step if it has none); the tokens the target emitted."""
        members, k = batch.members, batch.drafts_to_verify
        emitted = 0
        try:
            reply = await (self._verifying.pop(batch.batch_id, None) or self._call_verify(batch))
        except Exception as exc:
            if not self._lose_target(exc):
                fail_requests(self.outbox, members, exc)
        else:
            _check_rows("verify", reply.results, members)
            selected = bool(k and batch.drafts is not None and batch.drafts.selected)
            for request, result in zip(members, reply.results):
                verified = result.num_verified_drafts if selected else None
                request.record_verify(k, result.num_accepted, len(result.token_ids), verified)
                request.emit(list(result.token_ids), result.finish_reason, self.outbox, result.logprobs)
                emitted += len(result.token_ids)
            if self.metrics is not None:
                self.metrics.verified(reply.results, k, selected)
                if selected:
                    budget = self.verify_token_budget or batch.policy_drafts * len(members)
                    self.metrics.tetris_verified(reply.results, k, batch.policy_drafts, budget)
            if selected and self.extra_proposals is not None:
                self.extra_proposals.record_verify(reply.timings.compute_s)
        gone = [r for r in members + batch.joining if r.finished or r.cancelled]
        batch.open_membership()
        self.manager.rebalance(batch)
        await self._release(gone)
        return emitted

    async def _prefill_draft_again(self, running: Sequence[RequestState]) -> None:
        """A draft back: prefilled with every running request's prompt and output so far."""
        await self.workers.prefill_draft(running, resume=True)
        for request in running:
            request.drafted_from_here()

    def _lose_draft(self, exc: BaseException) -> bool:
        """Whether `exc`, from a draft call, lost the draft (`Failover.lose_draft_on`): the target decodes alone."""
        return self.failover.lose_draft_on(exc, self.manager.admitted_ids())

    def _lose_target(self, exc: BaseException) -> bool:
        """Whether `exc`, from a target call, lost the target (`Failover.lose_target_on`); if so every open request
        fails now (UNAVAILABLE: their clients may send them again)."""
        if not self.failover.lose_target_on(exc):
            return False
        self._fail_open(TARGET_LOST)
        return True

    def _fail_open(self, message: str) -> None:
        """End every request still open, in the batches or queued, with UNAVAILABLE (`message`) after what it was
        sent: its client may send it again."""
        held = self.manager.held()
        if held or self.manager.waiting:
            fail_requests(self.outbox, [*held, *self.manager.waiting], Unavailable(message))
        self.manager.waiting.clear()

    async def _drop_batches(self) -> None:
        """Cancel the verifies sent ahead (their results would go nowhere) and free every batch's rows on the
        workers, leaving the batches empty."""
        for call in self._verifying.values():
            call.cancel()
        await asyncio.gather(*self._verifying.values(), return_exceptions=True)
        self._verifying.clear()
        await self._release([r for b in self.manager.batches for r in b.clear()])

    async def _reconnect_target(self) -> None:
        """While the target is lost: fail what is still open (a loss its health stream found fails nothing by
        itself), release what the failed requests held, and take the target back (`Failover.take_target_back`,
        every retry interval; a stop cuts the wait short)."""
        self._fail_open(TARGET_LOST)
        await self.failover.report_target_lost()
        await self._drop_batches()
        if not await self.failover.target_back(lambda: self._stopping):
            return
        await self._flush_releases(always=True)  # a target that was only unreachable still holds them
        if self.failover.target_lost:  # gone again at once
            return
        await self.failover.report_target_back()

    async def _release(self, requests: Sequence[RequestState]) -> None:
        finish_cancelled(self.outbox, requests)
        self.workers.release_later([r.seq_id for r in requests])

    async def _flush_releases(self, always: bool = False) -> None:
        try:
            draft_error = await self.workers.flush_releases(always)
        except grpc.RpcError as exc:
            if not self._lose_target(exc):
                log.warning("release failed: %s", exc)
            return
        if draft_error is not None and not self._lose_draft(draft_error):
            log.warning("release failed on the draft: %s", draft_error)

    async def shutdown(self) -> None:
        """After the loop stopped: end every open stream (UNAVAILABLE, after the tokens it was sent: the client may
        retry elsewhere) and free its rows, so the workers can serve a new coordinator at once."""
        self.outbox.flush()
        self._fail_open("the coordinator stopped before this request finished: send it again")
        await self._drop_batches()
        await self._flush_releases(always=True)


async def _together(verify: Awaitable[int], propose: Awaitable[None]) -> tuple[int, None]:
    """A psd step's verify and propose at once; if one raises, the other is cancelled before the error goes on (a
    proposal must not land on batches the failed step's handler clears)."""
    tasks = (asyncio.ensure_future(verify), asyncio.ensure_future(propose))
    try:
        emitted, _ = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return emitted, None


def _check_rows(call: str, results: Sequence[object], requests: Sequence[RequestState]) -> None:
    """A worker's reply holds one result per row it was sent, or the step fails (INTERNAL), never a silent cut."""
    if len(results) != len(requests):
        raise RuntimeError(f"the {call} reply holds {len(results)} results for {len(requests)} sequences")


def fail_requests(outbox: StreamOutbox, requests: Sequence[RequestState], exc: BaseException) -> None:
    """End `requests` with `exc`, after what they emitted before (flushed first)."""
    log.warning("failing %d requests: %s", len(requests), exc)
    outbox.flush()
    for request in requests:
        request.fail(exc)


def finish_cancelled(outbox: StreamOutbox, requests: Sequence[RequestState]) -> None:
    """End the cancelled ones of `requests` still open as CANCELLED, after what they emitted before."""
    if any(r.cancelled and not r.finished for r in requests):
        outbox.flush()
    for request in requests:
        if request.cancelled and not request.finished:
            request.finish(FINISH.FINISH_REASON_CANCELLED)
