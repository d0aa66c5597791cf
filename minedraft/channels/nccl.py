"""The `nccl` channel: a two-rank communicator of the pair's own, never torch.distributed's default group (which a
tensor-parallel worker's ranks hold). On GPUs, CuPy's NCCL bindings: the draft side makes the unique id and the
handshake carries it (two communicators when tensors go back too, one per direction, so that neither direction's
sends wait behind the other's). On CPUs, a gloo group built from a store the draft side hosts: the handshake carries
its address (the one port of ours; gloo opens its own for the pair's connection, as NCCL does), and each direction
has a tag of its own."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from minedraft.channels.base import DTYPES, Channel, ReverseLayout
from minedraft.errors import ChannelSetupError, ModelLoadError
from minedraft.proto import common_pb2

log = logging.getLogger(__name__)
DRAFT_RANK, TARGET_RANK = 0, 1
FORWARD, BACK = 0, 1  # the directions: draft -> target, target -> draft (gloo tags; CuPy communicators)
RECEIVE_TIMEOUT = timedelta(seconds=120)  # each gloo receive (the set-up's bound is the channel's setup_timeout_s)
CUPY_MISSING = (
    "the nccl channel on GPUs needs CuPy: pip install 'minedraft[gpu]' (cupy-cuda12x), or the CuPy build for this "
    "machine's CUDA (cupy-cuda13x on CUDA 13); or pick another --channel"
)


def _advertised_host() -> str:
    """The address the target dials to reach the draft's rendezvous store."""
    host = os.environ.get("MINEDRAFT_ADVERTISE_HOST")
    if host:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _listen(host: str) -> socket.socket:
    """The rendezvous store's listening socket, on the address the target dials alone (the store would listen on
    every interface); on every interface only where that address is not one of this host's (a NAT's, a Service's).
    Bound here and handed to the store: no port picked, freed and bound again, which another socket could take."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, 0), family=family)
    except OSError:
        log.warning("the nccl rendezvous address %s is not one of this host's: listening on every interface", host)
        return socket.create_server(("", 0))


class _Pair(Protocol):
    def send(self, tensor: torch.Tensor, direction: int = FORWARD) -> None: ...
    def recv(self, tensor: torch.Tensor, direction: int = FORWARD) -> None: ...
    def close(self) -> None: ...


class _GlooPair:
    """Two ranks of a ProcessGroupGloo made from a TCPStore: no process-wide state is touched."""

    def __init__(
        self, host: str, port: int, rank: int, listener: socket.socket | None, timeout: timedelta = RECEIVE_TIMEOUT
    ) -> None:
        """`timeout`: the rendezvous's bound (the store's connect, and both ranks joining)."""
        fd = listener.detach() if listener is not None else None  # the store owns it from here, and closes it
        store = dist.TCPStore(host, port, 2, is_master=rank == DRAFT_RANK, timeout=timeout, master_listen_fd=fd)
        self.rank = rank
        # Blocks until both ranks are connected. (Any: torch's stubs give the backend no send or recv.)
        self.group: Any = dist.ProcessGroupGloo(store, rank, 2, timeout)
        # Receives may wait longer than the set-up: a verify can wait a while for its draft's proposal.
        self.group.set_timeout(max(timeout, RECEIVE_TIMEOUT))
        self._in_flight: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensor: torch.Tensor, direction: int = FORWARD) -> None:
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        # Asynchronous (a Propose reply must not wait for the Verify that posts the receive); the buffer must live.
        self._in_flight.append((self.group.send([tensor], 1 - self.rank, direction), tensor))

    def recv(self, tensor: torch.Tensor, direction: int = FORWARD) -> None:
        self.group.recv([tensor], 1 - self.rank, direction).wait()

    def close(self) -> None:
        self._in_flight.clear()  # (the group closes its connections once the channel drops this pair)


class _CupyPair:
    """Two ranks joined by CuPy NcclCommunicators, one per direction (the second only when tensors go back). Sends
    run on a stream of their own, after the caller's work, so that the sender's next kernels do not queue behind a
    send the other side has yet to receive; receives run on the caller's. Tensors move as their bytes."""

    def __init__(self, unique_ids: list[tuple[int, ...]], rank: int, device: torch.device) -> None:
        from cupy.cuda import nccl

        torch.cuda.set_device(device)
        self.rank, self.device = rank, device
        self.uint8 = int(nccl.NCCL_UINT8)
        self.stream = torch.cuda.Stream(device)
        self.comms = []
        for direction, unique_id in enumerate(unique_ids):
            self.comms.append(nccl.NcclCommunicator(2, unique_id, rank))  # blocks until both ranks have joined
            # NCCL connects a pair at its first exchange, which both sides must join. Done here, while both set up:
            # left to the first proposal, the draft's send would wait for a receive that comes only after the
            # Propose reply that send holds up (a deadlock seen on two H200s with torch's NCCL group).
            hello = torch.zeros(1, device=device)
            sender = DRAFT_RANK if direction == FORWARD else TARGET_RANK
            (self.send if rank == sender else self.recv)(hello, direction)
        torch.cuda.synchronize(device)

    def send(self, tensor: torch.Tensor, direction: int = FORWARD) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        tensor.record_stream(self.stream)  # the allocator keeps it until the send is done
        raw = tensor.view(torch.uint8)
        self.comms[direction].send(raw.data_ptr(), raw.numel(), self.uint8, 1 - self.rank, self.stream.cuda_stream)

    def recv(self, tensor: torch.Tensor, direction: int = FORWARD) -> None:
        stream = torch.cuda.current_stream(self.device).cuda_stream
        raw = tensor.view(torch.uint8)
        self.comms[direction].recv(raw.data_ptr(), raw.numel(), self.uint8, 1 - self.rank, stream)

    def close(self) -> None:
        for comm in self.comms:
            comm.abort()  # (not destroy: that waits on sends a lost peer will never receive)


def _check_cupy() -> None:
    try:
        import cupy.cuda.nccl  # noqa: F401
    except ImportError as exc:
        raise ModelLoadError(CUPY_MISSING) from exc


class NcclChannel(Channel):
    """Messages are matched by order, each direction on its own: drafts are verified in the order they were
    proposed, and the draft receives the target's tensors in the order they were sent (every TargetPayload must be
    received), so each side's receives pair with the other's sends one for one."""

    name = "nccl"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._pair: _Pair | None = None
        self._ready: threading.Thread | None = None
        self._error: BaseException | None = None

    def _join(self, handshake: dict[str, Any], rank: int, listener: socket.socket | None = None) -> None:
        try:
            if handshake["backend"] == "nccl":
                ids = [handshake[key] for key in ("unique_id", "back_unique_id") if key in handshake]
                self._pair = _CupyPair([tuple(i) for i in ids], rank, self.device)
            else:
                host, port = handshake["address"].rsplit(":", 1)
                timeout = timedelta(seconds=self.setup_timeout_s)
                self._pair = _GlooPair(host, int(port), rank, listener, timeout)
        except BaseException as exc:  # surfaced at the first send
            self._error = exc

    def export(
        self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int, reverse: ReverseLayout | None = None
    ) -> bytes:
        self.reverse = reverse
        handshake: dict[str, Any] = {"backend": self.backend, "reverse": None if reverse is None else reverse.to_json()}
        listener = None
        if self.backend == "nccl":
            _check_cupy()
            from cupy.cuda import nccl

            handshake["unique_id"] = list(nccl.get_unique_id())
            if reverse is not None:
                handshake["back_unique_id"] = list(nccl.get_unique_id())
        else:
            host = _advertised_host()
            listener = _listen(host)
            handshake["address"] = f"{host}:{listener.getsockname()[1]}"
        # The pair forms only once the target joins, after this reply: join in the background.
        self._ready = threading.Thread(target=self._join, args=(handshake, DRAFT_RANK, listener), daemon=True)
        self._ready.start()
        return json.dumps(handshake).encode()

    def attach(self, handshake: bytes) -> None:
        exported = json.loads(handshake)
        if exported["backend"] != self.backend:
            raise ValueError(
                f"nccl channel: the draft is on {exported['backend']} and the target on {self.backend} "
                "(both on GPUs or both on CPUs); pick another --channel"
            )
        if self.backend == "nccl":
            _check_cupy()
        self.reverse = ReverseLayout.from_json(exported.get("reverse"))
        where = exported.get("address", "the draft's unique id")
        # In a thread of its own, waited for a bounded time: NCCL's set-up has no timeout of its own.
        joining = threading.Thread(target=self._join, args=(exported, TARGET_RANK), daemon=True)
        joining.start()
        joining.join(self.setup_timeout_s + 1.0)  # (gloo's own bound, the same, ends it first)
        if joining.is_alive():
            self._error = TimeoutError(f"no answer within {self.setup_timeout_s:g} s")
        if self._error is not None:
            raise ChannelSetupError(f"nccl channel rendezvous with {where} failed: {self._error}")

    def _wait_ready(self) -> _Pair:
        if self._ready is not None:
            self._ready.join()
            self._ready = None
        if self._error is not None:
            raise RuntimeError(f"nccl channel set-up failed: {self._error}")
        assert self._pair is not None, "export() or attach() first"
        return self._pair

    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        pair = self._wait_ready()
        payload = common_pb2.DraftPayload(
            channel=self.name, step_id=step_id, batch_size=draft_ids.shape[0], num_tokens=draft_ids.shape[1]
        )
        pair.send(draft_ids.to(torch.long).contiguous())
        if draft_probs is not None:
            pair.send(draft_probs.to(torch.float32).contiguous())
            payload.probs_shape.extend(draft_probs.shape)
            payload.probs_dtype = "float32"
        return payload

    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        pair = self._wait_ready()
        ids = torch.empty(payload.batch_size, payload.num_tokens, dtype=torch.long, device=self.device)
        pair.recv(ids)
        if not payload.probs_shape:
            return ids, None
        probs = torch.empty(tuple(payload.probs_shape), dtype=DTYPES[payload.probs_dtype], device=self.device)
        pair.recv(probs)
        return ids, probs

    def send_back(self, step_id: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TargetPayload:
        payload = self.check_back(step_id, tensors)
        pair = self._wait_ready()
        for entry in payload.tensors:
            # A copy: the send reads it later (gloo in the background, NCCL on its own stream), and a target's
            # hidden states are often views of buffers its next step overwrites.
            pair.send(tensors[entry.name].detach().clone(memory_format=torch.contiguous_format), BACK)
        return payload

    def receive_back(self, payload: common_pb2.TargetPayload) -> dict[str, torch.Tensor]:
        pair = self._wait_ready()
        out = {}
        for entry in payload.tensors:
            out[entry.name] = torch.empty(tuple(entry.shape), dtype=DTYPES[entry.dtype], device=self.device)
            pair.recv(out[entry.name], BACK)
        return out

    def close(self) -> None:
        if self._ready is not None and not self._ready.is_alive():
            self._ready = None
        if self._ready is None and self._pair is not None:  # (a pair still forming is left to its daemon thread)
            self._pair.close()
        self._pair = None
