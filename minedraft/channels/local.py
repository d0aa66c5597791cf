"""The `local` channel: draft and target in one process hand tensors over through an in-process mailbox."""

from __future__ import annotations

import secrets
import threading

import torch

from minedraft.channels.base import Channel
from minedraft.proto import common_pb2

_mailboxes: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event | None]]] = {}
_lock = threading.Lock()


class LocalChannel(Channel):
    name = "local"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.key = ""

    def export(self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int) -> bytes:
        self.key = secrets.token_hex(8)
        with _lock:
            _mailboxes[self.key] = {}
        return self.key.encode()

    def attach(self, handshake: bytes) -> None:
        self.key = handshake.decode()
        with _lock:
            if self.key not in _mailboxes:
                raise ValueError("local channel: the draft service is not in this process")

    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        ready = None
        if draft_ids.is_cuda:  # the target reads on its own stream: order it after the draft's kernels
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(draft_ids.device))
        with _lock:
            _mailboxes[self.key][step_id] = (draft_ids, draft_probs, ready)
        return common_pb2.DraftPayload(
            channel=self.name, step_id=step_id, batch_size=draft_ids.shape[0], num_tokens=draft_ids.shape[1]
        )

    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        with _lock:
            ids, probs, ready = _mailboxes[self.key].pop(payload.step_id)
        if ready is not None and self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            for tensor in (ids, probs):  # their memory is the draft stream's: keep it until this stream is done
                if tensor is not None and tensor.device == self.device:
                    tensor.record_stream(stream)
        return ids.to(self.device), None if probs is None else probs.to(self.device)

    def close(self) -> None:
        with _lock:
            _mailboxes.pop(self.key, None)
