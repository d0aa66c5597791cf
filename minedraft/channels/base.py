"""The channel interface every transport implements (`registry.make_channel` picks one by name)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from minedraft.proto import common_pb2


class Channel(ABC):
    """One draft -> target link. The draft side exports a handshake, the target side attaches to it once; then
    each proposal is `send` on the draft side and `receive` on the target side, with the returned `DraftPayload`
    carried between them unchanged by the coordinator (it holds bytes only for the `grpc` channel)."""

    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def export(self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int) -> bytes:
        """Draft side: allocate what the transport needs; the bytes go to the target's `attach`."""
        return b""

    def attach(self, handshake: bytes) -> None:
        """Target side: connect to what the draft side exported."""

    @abstractmethod
    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        """Draft side: make `[B, k]` ids (and `[B, k, V]` probs) available to the target."""

    @abstractmethod
    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target side: the ids and probs of `payload`, on the target's device."""

    def close(self) -> None:
        """Release transport resources."""
