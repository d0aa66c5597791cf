"""The `local` channel: draft and target in one process hand tensors over through in-process mailboxes."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Mapping

import torch

from minedraft.channels.base import Channel, ReverseLayout, encode_layout
from minedraft.proto import common_pb2

_Ready = torch.cuda.Event | None
# Per channel key: the drafts by step id (draft -> target), and the target's tensors by step id (target -> draft).
_mailboxes: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor | None, _Ready]]] = {}
_back_mailboxes: dict[str, dict[int, tuple[dict[str, torch.Tensor], _Ready]]] = {}
_lock = threading.Lock()


def _ready_event(tensor: torch.Tensor) -> _Ready:
    """On CUDA, an event after the sender's kernels: the receiver reads on its own stream."""
    if not tensor.is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(tensor.device))
    return ready


def _wait(ready: _Ready, device: torch.device, tensors: list[torch.Tensor | None]) -> None:
    if ready is not None and device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        stream.wait_event(ready)
        for tensor in tensors:  # their memory is the sender's stream's: keep it until this stream is done
            if tensor is not None and tensor.device == device:
                tensor.record_stream(stream)


class LocalChannel(Channel):
    name = "local"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.key = ""

    def export(
        self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int, reverse: ReverseLayout | None = None
    ) -> bytes:
        self.reverse = reverse
        self.key = secrets.token_hex(8)
        with _lock:
            _mailboxes[self.key] = {}
            _back_mailboxes[self.key] = {}
        return self.key.encode() + b"\n" + encode_layout(reverse)

    def attach(self, handshake: bytes) -> None:
        key, _, layout = handshake.partition(b"\n")
        super().attach(layout)
        self.key = key.decode()
        with _lock:
            if self.key not in _mailboxes:
                raise ValueError("local channel: the draft service is not in this process")

    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        ready = _ready_event(draft_ids)
        with _lock:
            _mailboxes[self.key][step_id] = (draft_ids, draft_probs, ready)
        return common_pb2.DraftPayload(
            channel=self.name, step_id=step_id, batch_size=draft_ids.shape[0], num_tokens=draft_ids.shape[1]
        )

    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _lock:
            ids, probs, ready = _mailboxes[self.key].pop(payload.step_id)
        _wait(ready, self.device, [ids, probs])
        return ids.to(self.device), None if probs is None else probs.to(self.device)

    def send_back(self, step_id: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TargetPayload:
        payload = self.check_back(step_id, tensors)
        # Copies: a target's hidden states are often views of buffers its next step overwrites.
        copies = {name: tensor.detach().clone() for name, tensor in tensors.items()}
        ready = _ready_event(next(iter(copies.values())))
        with _lock:
            _back_mailboxes[self.key][step_id] = (copies, ready)
        return payload

    def receive_back(self, payload: common_pb2.TargetPayload) -> dict[str, torch.Tensor]:
        with _lock:
            tensors, ready = _back_mailboxes[self.key].pop(payload.step_id)
        _wait(ready, self.device, list(tensors.values()))
        return {name: tensor.to(self.device) for name, tensor in tensors.items()}

    def close(self) -> None:
        with _lock:
            _mailboxes.pop(self.key, None)
            _back_mailboxes.pop(self.key, None)
