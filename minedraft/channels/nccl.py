"""The `nccl` channel: a two-rank torch.distributed group per pair (gloo on CPU), rendezvous over gRPC."""

from __future__ import annotations

import logging
import os
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from minedraft.channels.base import Channel
from minedraft.proto import common_pb2

log = logging.getLogger(__name__)
DRAFT_RANK, TARGET_RANK = 0, 1
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


class NcclChannel(Channel):
    """Messages are matched by order: drafts are verified in the order they were proposed, so the target's
    receives pair with the draft's sends one for one. The draft side sends asynchronously (a Propose reply must
    not wait for the Verify that will post the matching receive)."""

    name = "nccl"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self._ready: threading.Thread | None = None
        self._error: BaseException | None = None
        self._in_flight: list[tuple[dist.Work, torch.Tensor]] = []
        self._listener: socket.socket | None = None  # the draft's rendezvous socket, open while the store lives

    def _join(self, host: str, port: int, rank: int, listener: socket.socket | None = None) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            fd = listener.fileno() if listener is not None else None
            store = dist.TCPStore(
                host, port, 2, is_master=rank == DRAFT_RANK, timeout=timedelta(seconds=120), master_listen_fd=fd
            )
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
            # NCCL builds the pair's send/receive communicator at their first exchange, which both sides must
            # join. Done here, while both are setting up: left to the first proposal, the draft's send would wait
            # for the target's receive, which comes only after the Propose reply that send holds up (a deadlock
            # seen on two H200s).
            hello = torch.zeros(1, device=self.device)
            if rank == DRAFT_RANK:
                dist.send(hello, dst=TARGET_RANK)
            else:
                dist.recv(hello, src=DRAFT_RANK)
        except BaseException as exc:  # surfaced at the first send
            self._error = exc

    def export(self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int) -> bytes:
        host = _advertised_host()
        self._listener = _listen(host)
        port = self._listener.getsockname()[1]
        # init_process_group blocks until the target joins, which happens only after this reply: join in background.
        self._ready = threading.Thread(target=self._join, args=(host, port, DRAFT_RANK, self._listener), daemon=True)
        self._ready.start()
        return f"{host}:{port}".encode()

    def attach(self, handshake: bytes) -> None:
        host, port = handshake.decode().rsplit(":", 1)
        self._join(host, int(port), TARGET_RANK)
        if self._error is not None:
            raise ValueError(f"nccl channel rendezvous with {host}:{port} failed: {self._error}")

    def _wait_ready(self) -> None:
        if self._ready is not None:
            self._ready.join()
            self._ready = None
        if self._error is not None:
            raise RuntimeError(f"nccl channel set-up failed: {self._error}")

    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        self._wait_ready()
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        payload = common_pb2.DraftPayload(
            channel=self.name, step_id=step_id, batch_size=draft_ids.shape[0], num_tokens=draft_ids.shape[1]
        )
        tensors = [draft_ids.to(torch.long).contiguous()]
        if draft_probs is not None:
            tensors.append(draft_probs.to(torch.float32).contiguous())
            payload.probs_shape.extend(draft_probs.shape)
            payload.probs_dtype = "float32"
        for tensor in tensors:  # the buffer must outlive the asynchronous send
            work = dist.isend(tensor, dst=TARGET_RANK)
            assert work is not None
            self._in_flight.append((work, tensor))
        return payload

    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.empty(payload.batch_size, payload.num_tokens, dtype=torch.long, device=self.device)
        dist.recv(ids, src=DRAFT_RANK)
        if not payload.probs_shape:
            return ids, None
        probs = torch.empty(tuple(payload.probs_shape), dtype=_DTYPES[payload.probs_dtype], device=self.device)
        dist.recv(probs, src=DRAFT_RANK)
        return ids, probs

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
