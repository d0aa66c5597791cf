"""A target and a draft as a pair: the checks that they fit, the channel between them, and their start-up work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from minedraft.engine.models import VocabInfo, check_pair
from minedraft.errors import ModelLoadError
from minedraft.proto import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from minedraft.rpc.lease import Ticket

log = logging.getLogger(__name__)

LEASE_RETRY_S = 0.5  # between tries for a worker another coordinator holds, at start-up
SETUP_CALL_SLACK_S = 10.0  # at most, a SetupChannel call's deadline past the rendezvous's bound (the call's own work)


@dataclass(frozen=True)
class Layout:
    """The step shapes both workers prepare for: the batches, and the draft lengths steps may take (the longest
    first; none in ar)."""

    max_batch_size: int
    num_batches: int
    num_speculative_tokens: int  # the longest draft (with TETRIS, its extra drafts included)
    draft_lengths: tuple[int, ...]
    tetris: bool = False  # proposals scored and selected, verifies of selected drafts (design section 14)

    def target_prepares(self) -> list[target_pb2.TargetServicePrepareRequest]:
        """The target's Prepare calls: each draft length's verifies (and the target's steps alone)."""
        return [
            target_pb2.TargetServicePrepareRequest(
                num_speculative_tokens=length,
                max_batch_size=self.max_batch_size,
                num_batches=self.num_batches,
                tetris=self.tetris,
            )
            for length in self.draft_lengths or (0,)
        ]

    def draft_prepares(self) -> list[draft_pb2.DraftServicePrepareRequest]:
        return [
            draft_pb2.DraftServicePrepareRequest(
                num_speculative_tokens=length,
                max_batch_size=self.max_batch_size,
                num_batches=self.num_batches,
                tetris=self.tetris,
            )
            for length in self.draft_lengths
        ]


def choose_channel(requested: str, target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo) -> str:
    """cuda-ipc when both sides are CUDA on one host, else nccl between GPUs, else grpc; a flag overrides."""
    if requested != "auto":
        for side, info in (("target", target), ("draft", draft)):
            if requested not in info.channels:
                raise ModelLoadError(f"channel {requested!r} is not available on the {side} ({info.device})")
        return requested
    both_cuda = target.device.startswith("cuda") and draft.device.startswith("cuda")
    if both_cuda and target.host_id == draft.host_id:
        return "cuda-ipc"
    return "nccl" if both_cuda else "grpc"


def shared_gpus(target: common_pb2.WorkerInfo, draft: common_pb2.WorkerInfo) -> list[str]:
    """The GPUs that target and draft both run on, by UUID (a GPU's index differs between containers); a worker of
    before `gpu_uuids` names its first GPU only."""

    def gpus(info: common_pb2.WorkerInfo) -> list[str]:
        return list(info.gpu_uuids) or ([info.gpu_uuid] if info.gpu_uuid else [])

    return [gpu for gpu in gpus(target) if gpu in gpus(draft)]


def vocab_of(info: common_pb2.WorkerInfo) -> VocabInfo:
    return VocabInfo(info.logits_size, info.tokenizer_size, info.tokenizer_hash, tuple(info.eos_token_ids))


def call_detail(exc: BaseException) -> str:
    """A failed call's message: a gRPC error's details, or the exception's text."""
    return str(exc.details()) if isinstance(exc, grpc.aio.AioRpcError) else str(exc)


async def prepare_worker(
    rpc: Callable[[Any], Awaitable[object]], requests: Sequence[object], unprepared: Callable[[], None] = lambda: None
) -> float:
    """A worker's Prepare calls, one after the other (one per draft length); returns the seconds they took. A worker
    older than that RPC answers UNIMPLEMENTED and prepares in its SetupChannel instead (`unprepared` is told): a
    rolling upgrade can start a new coordinator before its workers."""
    start = time.perf_counter()
    try:
        for request in requests:
            await rpc(request)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        log.info("a worker without Prepare: it prepares in SetupChannel")
        unprepared()
    return time.perf_counter() - start


class Pair:
    """A target and (but in ar) a draft service made one: what each reported, the channel chosen between them, and
    the control calls that set them up, at start-up and again for a worker back after a loss (`Workers`)."""

    def __init__(
        self,
        target: target_pb2_grpc.TargetServiceStub,
        draft: draft_pb2_grpc.DraftServiceStub | None,
        channel: str = "auto",
        tickets: dict[str, Ticket] | None = None,
        endpoints: tuple[str, str] = ("the target", "the draft"),
        channel_setup_timeout: float = 60.0,
    ) -> None:
        """`channel`: the data plane asked for ("auto": `choose_channel`'s); `tickets`: the leases the channels to
        "target" and "draft" present (taken here, at each set-up); `endpoints`: the two workers' addresses, for the
        messages; `channel_setup_timeout`: seconds the channel's rendezvous may take."""
        self._target, self._draft = target, draft
        self.endpoints = endpoints
        self.channel_setup_timeout = channel_setup_timeout
        self.tickets = tickets if tickets is not None else {"target": Ticket(""), "draft": Ticket("")}
        self._requested_channel = channel
        self.target_info = common_pb2.WorkerInfo()
        self.draft_info = common_pb2.WorkerInfo()
        self.channel = "none"
        self._layout: Layout | None = None  # what `set_up` prepared them for, again at each set-up after a loss
        self._setup_bounded = True  # whether the SetupChannel calls get a deadline (both workers have Prepare)

    @property
    def max_model_len(self) -> int:
        """The most tokens a sequence may hold on both workers."""
        lengths = [self.target_info.max_model_len]
        if self._draft is not None:
            lengths.append(self.draft_info.max_model_len)
        return min(lengths)

    async def connect(self) -> None:
        """At start-up: both workers' info, checked as a pair, and the channel between them chosen (`set_up` then
        prepares them, for a layout that may depend on what they reported)."""
        self.target_info = (await self._target.GetInfo(target_pb2.TargetServiceGetInfoRequest())).info
        await self.take_lease("target", wait=True)
        if self._draft is not None:
            await self._pair_draft(wait=True)

    async def set_up(self, layout: Layout) -> None:
        """At start-up, after `connect`: prepare both workers for `layout` and set the channel up."""
        self._layout = layout
        if self._draft is not None:
            await self._prepare_and_link()
        else:
            log.info("target prepared in %.1f s", await self._prepare_target())

    async def set_up_draft_again(self, timeout: float = 2.0) -> None:
        """A draft back after a loss (`timeout`: for its GetInfo): checked against the target and set up again."""
        await self._pair_draft(timeout)
        await self._prepare_and_link()

    async def set_up_target_again(self, with_draft: bool, timeout: float = 2.0) -> None:
        """A target back after a loss (`timeout`: for its GetInfo): the model it serves must be the one it served;
        it is set up again, with the draft when one is in use (`with_draft`)."""
        info = (await self._target.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=timeout)).info
        if vocab_of(info) != vocab_of(self.target_info):
            raise ModelLoadError(f"the target came back serving {info.model}, not {self.target_info.model}")
        self.target_info = info
        await self.take_lease("target", timeout=timeout)
        if with_draft:
            await self.set_up_draft_again(timeout)
        else:
            log.info("target prepared in %.1f s", await self._prepare_target())

    async def _pair_draft(self, timeout: float | None = None, wait: bool = False) -> None:
        """The draft's info, checked against the target's, its lease taken, and the channel chosen."""
        assert self._draft is not None
        self.draft_info = (await self._draft.GetInfo(draft_pb2.DraftServiceGetInfoRequest(), timeout=timeout)).info
        check_pair(vocab_of(self.target_info), vocab_of(self.draft_info))
        await self.take_lease("draft", wait=wait, timeout=timeout)
        self.channel = choose_channel(self._requested_channel, self.target_info, self.draft_info)

    async def take_lease(self, worker: str, wait: bool = False, timeout: float | None = None) -> None:
        """A new lease on `worker` ("target" or "draft"), which frees what an earlier one held there; `wait`: while
        another coordinator holds it, until its lease expires (start-up), rather than fail. A worker older than
        leases answers UNIMPLEMENTED and serves without."""
        ticket = self.tickets[worker]
        waiting = False
        while True:
            try:
                reply = await self._lease_call(worker, ticket.owner, 0, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    ticket.epoch, ticket.ttl_s = 0, 0.0
                    return
                if not wait or exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                if not waiting:
                    log.warning("the %s refuses this coordinator (%s); waiting for that lease", worker, exc.details())
                    waiting = True
                await asyncio.sleep(LEASE_RETRY_S)
                continue
            ticket.epoch, ticket.ttl_s = reply.lease.epoch, reply.lease.ttl_s
            if waiting:
                log.warning("the %s's lease taken (epoch %d)", worker, ticket.epoch)
            return

    def _lease_call(
        self, worker: str, owner: str, epoch: int, give_up: bool = False, timeout: float | None = None
    ) -> Awaitable[Any]:
        if worker == "target":
            request = target_pb2.TargetServiceLeaseRequest(owner=owner, epoch=epoch, give_up=give_up)
            return self._target.Lease(request, timeout=timeout)
        assert self._draft is not None
        request_draft = draft_pb2.DraftServiceLeaseRequest(owner=owner, epoch=epoch, give_up=give_up)
        return self._draft.Lease(request_draft, timeout=timeout)

    async def renew_lease(self, worker: str, timeout: float) -> None:
        """The heartbeat of `worker`'s lease; FAILED_PRECONDITION once it is no longer this coordinator's."""
        ticket = self.tickets[worker]
        if ticket.epoch:
            await self._lease_call(worker, ticket.owner, ticket.epoch, timeout=timeout)

    async def give_up_leases(self, timeout: float = 2.0) -> None:
        """At the coordinator's stop: both leases given up, so that a new coordinator need not wait them out."""
        workers = ["target"] + (["draft"] if self._draft is not None else [])
        for worker in workers:
            ticket = self.tickets[worker]
            if ticket.epoch:
                with contextlib.suppress(grpc.RpcError):
                    await self._lease_call(worker, ticket.owner, ticket.epoch, give_up=True, timeout=timeout)
                ticket.epoch = 0

    async def _prepare_and_link(self) -> None:
        """Both workers' start-up work, then the channel through both workers' control RPCs."""
        layout, draft = self._layout, self._draft
        assert layout is not None and draft is not None
        # Both workers' start-up work at once, not one after the other inside the SetupChannels below (which then
        # find it done): a compiled 8B/1B pair spent 53 s in the draft's and then 75 s in the target's. For a
        # restarted draft, the target's is a no-op.
        self._setup_bounded = True  # (not where a worker prepares in its SetupChannel: that can take minutes)
        draft_s, target_s = await asyncio.gather(
            prepare_worker(draft.Prepare, layout.draft_prepares(), self._unbound_setup), self._prepare_target()
        )
        start = time.perf_counter()
        try:
            await self._link(layout)
        except (grpc.RpcError, ValueError) as exc:
            raise ModelLoadError(self._setup_failure(exc)) from exc
        log.info(
            "workers prepared in %.1f s (draft %.1f s, target %.1f s, at once); %s channel set up in %.1f s",
            max(draft_s, target_s),
            draft_s,
            target_s,
            self.channel,
            time.perf_counter() - start,
        )

    async def _link(self, layout: Layout) -> None:
        """The channel through both workers' SetupChannel: the draft exports, the target attaches (and returns the
        reverse direction's end, where its transport has one), the draft attaches back; each call bounded."""
        assert self._draft is not None
        bound = self.channel_setup_timeout
        sizes: dict[str, Any] = {
            "channel": self.channel,
            "num_speculative_tokens": layout.num_speculative_tokens,
            "max_batch_size": layout.max_batch_size,
            "num_batches": layout.num_batches,
            "setup_timeout_s": bound,
        }
        deadline = self.setup_call_deadline if self._setup_bounded else None
        exported = self._draft.SetupChannel(draft_pb2.DraftServiceSetupChannelRequest(**sizes), timeout=deadline)
        # Some transports (nccl) rendezvous: the draft's export and the target's attach must overlap.
        handshake = (await exported).handshake
        request = target_pb2.TargetServiceSetupChannelRequest(handshake=handshake, **sizes)
        back = (await self._target.SetupChannel(request, timeout=deadline)).handshake
        if back:
            second = draft_pb2.DraftServiceSetupChannelRequest(channel=self.channel, handshake=back, attach_back=True)
            await self._draft.SetupChannel(second, timeout=deadline)

    @property
    def setup_call_deadline(self) -> float:
        """A SetupChannel call's deadline: the rendezvous's bound, and as much again (10 s at most) for the rest."""
        return self.channel_setup_timeout + min(self.channel_setup_timeout, SETUP_CALL_SLACK_S)

    def _setup_failure(self, exc: BaseException) -> str:
        """One line: which channel failed between which endpoints, why, and the flags that change it."""
        detail = " ".join(call_detail(exc).split()) or type(exc).__name__
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            detail = f"no answer within {self.setup_call_deadline:g} s"
        target, draft = self.endpoints
        return (
            f"the {self.channel} channel between the target at {target} and the draft at {draft} could not be set "
            f"up ({detail}); pick another --channel (grpc works between any two hosts), or allow the rendezvous more "
            f"than --channel-setup-timeout {self.channel_setup_timeout:g} s"
        )

    async def close_channel(self, worker: str, timeout: float = 2.0) -> None:
        """Close `worker`'s end ("target" or "draft") of the channel: its peer is lost, and what the channel holds
        (a lost draft's GPU buffers the target maps) is freed now rather than at the next set-up."""
        if worker == "target":
            await self._target.SetupChannel(target_pb2.TargetServiceSetupChannelRequest(close=True), timeout=timeout)
        elif self._draft is not None:
            await self._draft.SetupChannel(draft_pb2.DraftServiceSetupChannelRequest(close=True), timeout=timeout)

    async def _prepare_target(self) -> float:
        """The target's Prepare (its cache laid out for the batches, their step shapes run before serving); the
        seconds it took. With the draft's in `_prepare_and_link`, alone when no draft is connected (ar; a target
        back while the draft is lost): unprepared, an ar target captures each CUDA graph at its shape's first use,
        while requests wait."""
        assert self._layout is not None
        return await prepare_worker(self._target.Prepare, self._layout.target_prepares(), self._unbound_setup)

    def _unbound_setup(self) -> None:
        self._setup_bounded = False
