"""The batch manager: a bounded waiting queue and two batches that alternate between drafting and verifying."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from coordinator.request_state import RequestState
from minedraft.proto import common_pb2


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the client should retry later."""


@dataclass
class Batch:
    """Sequences that are drafted and verified together. `drafts` is set between Propose and Verify: then the
    membership is frozen, and sequences that join wait in `joining` until the verify is done."""

    batch_id: int
    members: list[RequestState] = field(default_factory=list)
    joining: list[RequestState] = field(default_factory=list)
    drafts: common_pb2.DraftPayload | None = None
    num_drafts: int = 0
    policy_drafts: int = 0  # the speculation policy's k of those drafts (TETRIS's extra drafts aside)

    @property
    def size(self) -> int:
        return len(self.members) + len(self.joining)

    @property
    def awaiting_verify(self) -> bool:
        return self.drafts is not None

    @property
    def drafts_to_verify(self) -> int:
        """k of the batch's next verify: 0 when it was not drafted (a plain decode step)."""
        return self.num_drafts if self.awaiting_verify else 0

    def begin_propose(self) -> None:
        """Its drafts are being made: the membership is frozen until its verify (a rebalance by the other batch's
        concurrent verify puts its surplus in `joining`, not among the members whose drafts are being made)."""
        self.drafts = common_pb2.DraftPayload()

    def drafted(self, drafts: common_pb2.DraftPayload, k: int, policy_k: int | None = None) -> None:
        """Its members' `k` drafts each are made, to be verified (`policy_k`: the policy's k of them; None: k)."""
        self.drafts, self.num_drafts = drafts, k
        self.policy_drafts = k if policy_k is None else policy_k

    def propose_failed(self) -> None:
        """No drafts came: failed members stay until `BatchManager.remove_finished` releases them; joiners join."""
        self.drafts, self.members, self.joining = None, self.members + self.joining, []

    def clear(self) -> list[RequestState]:
        """Everything dropped (the target lost, or the coordinator stopping): what it held, to release."""
        held, self.drafts, self.members, self.joining = self.members + self.joining, None, [], []
        return held

    def open_membership(self) -> None:
        """After a verify: drop what finished or was cancelled, and let the joiners in."""
        self.drafts = None
        self.members = [r for r in self.members + self.joining if not (r.finished or r.cancelled)]
        self.joining = []


class BatchManager:
    def __init__(self, max_batch_size: int, max_queue_size: int, num_batches: int, max_prefill_tokens: int = 0) -> None:
        """`max_prefill_tokens`: the most prompt tokens one step's prefill takes (0: no limit): a burst of arrivals
        is admitted over several steps, so that the first of them start decoding sooner and running sequences are
        not held for the whole burst's prefill (39 prompts of 512 tokens hold an 8B target for 1.07 s)."""
        self.max_batch_size = max_batch_size
        self.max_queue_size = max_queue_size
        self.max_prefill_tokens = max_prefill_tokens
        self.batches = [Batch(i) for i in range(num_batches)]
        self.waiting: collections.deque[RequestState] = collections.deque()

    def merge_batches(self) -> None:
        """One batch of all the batches' room, before anything is admitted (`GenerationServicer`: a GPU that target
        and draft share)."""
        assert not self.waiting and self.num_running == 0, "batches merge only before serving"
        self.max_batch_size *= len(self.batches)
        self.batches = [Batch(0)]

    def submit(self, request: RequestState) -> None:
        if len(self.waiting) >= self.max_queue_size:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_queue_size} requests); retry later or raise --max-queue-size"
            )
        self.waiting.append(request)

    def submit_all(self, requests: list[RequestState]) -> None:
        """Queue the samples of one request (GenerateRequest.n) all or none: each counts against the bound."""
        if len(self.waiting) + len(requests) > self.max_queue_size:
            raise QueueFullError(
                f"the waiting queue cannot take {len(requests)} more requests ({len(self.waiting)} of "
                f"{self.max_queue_size} wait; each of n samples counts); retry later or raise --max-queue-size"
            )
        self.waiting.extend(requests)

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(b.size for b in self.batches)

    def running(self) -> list[RequestState]:
        """Admitted requests still decoding, in every batch."""
        return [r for b in self.batches for r in b.members + b.joining if not (r.finished or r.cancelled)]

    def take_admissions(
        self,
        memory: Callable[[RequestState], bool] = lambda request: True,
        cost: Callable[[RequestState], int] = lambda request: len(request.prefill_ids),
    ) -> list[tuple[Batch, list[RequestState]]]:
        """Pop waiting requests into the emptier batch, one at a time, while there is room (balance by count), the
        prefill stays within `max_prefill_tokens` of what it computes (`cost`: the tokens a request's prefill
        computes; a first request always goes in, however long) and `memory` says the workers' KV blocks hold the
        request (it is asked in order, and counts what it said yes to).

        Cancelled requests still in the queue are dropped here. A batch whose drafts are in flight gets new
        sequences as joiners; the others take them as members at once.
        """
        placed: dict[int, list[RequestState]] = {}
        tokens = 0
        while self.waiting:
            request = self.waiting[0]
            if request.cancelled:
                self.waiting.popleft()
                continue
            batch = min(self.batches, key=lambda b: (b.size, b.awaiting_verify))
            if batch.size >= self.max_batch_size:
                break
            tokens += cost(request)
            if self.max_prefill_tokens and placed and tokens > self.max_prefill_tokens:
                break
            if not memory(request):
                break
            self.waiting.popleft()
            (batch.joining if batch.awaiting_verify else batch.members).append(request)
            placed.setdefault(batch.batch_id, []).append(request)
        return [(self.batches[i], placed[i]) for i in sorted(placed)]

    def rebalance(self, batch: Batch) -> None:
        """When `batch` (just verified) holds two or more sequences more than the other, move the surplus over."""
        if len(self.batches) < 2:
            return
        other = self.batches[1 - batch.batch_id]
        surplus = (len(batch.members) - other.size) // 2
        if surplus > 0:
            moved, batch.members = batch.members[-surplus:], batch.members[:-surplus]
            (other.joining if other.awaiting_verify else other.members).extend(moved)

    def preempt_latest(self, batch: Batch) -> RequestState:
        """Take the batch's most recently admitted member (not in flight) out, to the front of the queue."""
        request = max(batch.members, key=lambda r: r.decode.admitted)
        request.preempt()
        self.requeue([request])
        return request

    def requeue(self, requests: Sequence[RequestState]) -> None:
        """Take admitted requests out of the batches (members or joiners) and back to the front of the queue, in
        their order, to be prefilled again: one preempted, or a group whose prefill found no room on a worker."""
        leaving = {id(r) for r in requests}  # (requests compare by value)
        for batch in self.batches:
            batch.members[:] = [r for r in batch.members if id(r) not in leaving]
            batch.joining[:] = [r for r in batch.joining if id(r) not in leaving]
        self.waiting.extendleft(reversed(requests))

    def remove_finished(self, batch: Batch) -> list[RequestState]:
        """Drop finished or cancelled members of a batch not in flight; return them for release on the workers."""
        gone = [r for r in batch.members if r.finished or r.cancelled]
        batch.members = [r for r in batch.members if not (r.finished or r.cancelled)]
        return gone

    def held(self) -> list[RequestState]:
        """The unfinished requests in the batches."""
        return [r for b in self.batches for r in b.members + b.joining if not r.finished]

    def admitted_ids(self) -> Iterator[int]:
        """The sequences in the batches, what a worker may hold (lazily: read only where a draft is dropped)."""
        return (r.seq_id for b in self.batches for r in b.members + b.joining)
