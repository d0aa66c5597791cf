"""The channel interface every transport implements (`registry.make_channel` picks one by name)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from minedraft.proto import common_pb2

SETUP_TIMEOUT_S = 120.0  # a rendezvous's bound when the coordinator names none
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class ReverseLayout:
    """What the target sends back to the draft (hidden states for EAGLE heads), sized at set-up."""

    max_rows: int  # most rows one send_back carries
    tensors: tuple[tuple[str, int, torch.dtype], ...]  # (name, width, dtype) of each named [rows, width] tensor

    def to_json(self) -> dict[str, Any]:
        return {"max_rows": self.max_rows, "tensors": [[n, w, DTYPE_NAMES[d]] for n, w, d in self.tensors]}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> ReverseLayout | None:
        if data is None:
            return None
        return cls(data["max_rows"], tuple((n, int(w), DTYPES[d]) for n, w, d in data["tensors"]))


def encode_layout(reverse: ReverseLayout | None) -> bytes:
    """The reverse layout as a handshake of its own (the transports whose handshake carries nothing else)."""
    return b"" if reverse is None else json.dumps({"reverse": reverse.to_json()}).encode()


def decode_layout(handshake: bytes) -> ReverseLayout | None:
    return ReverseLayout.from_json(json.loads(handshake)["reverse"]) if handshake else None


class Channel(ABC):
    """One draft <-> target link. The draft side exports a handshake, the target side attaches to it once (and
    where the transport needs it, the target side's `export_back` goes to the draft side's `attach_back`); then
    each proposal is `send` on the draft side and `receive` on the target side, and (with a `ReverseLayout` set up)
    the target's tensors for the draft are `send_back` on the target side and `receive_back` on the draft side. The
    payloads are carried between them unchanged by the coordinator (it holds bytes only for the `grpc` channel)."""

    name: ClassVar[str]

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reverse: ReverseLayout | None = None  # what send_back may carry; None: nothing
        self.setup_timeout_s = SETUP_TIMEOUT_S  # how long a rendezvous may take (the coordinator's, when it names one)

    def export(
        self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int, reverse: ReverseLayout | None = None
    ) -> bytes:
        """Draft side: allocate what the transport needs; the bytes go to the target's `attach`."""
        self.reverse = reverse
        return encode_layout(reverse)

    def attach(self, handshake: bytes) -> None:
        """Target side: connect to what the draft side exported (and learn the reverse layout from it)."""
        self.reverse = decode_layout(handshake)

    def export_back(self) -> bytes:
        """Target side, after `attach`: what the draft side's `attach_back` needs for the reverse direction."""
        return b""

    def attach_back(self, handshake: bytes) -> None:
        """Draft side, after `export`: connect to what the target side's `export_back` returned."""

    @abstractmethod
    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        """Draft side: make `[B, k]` ids (and `[B, k, V]` probs) available to the target."""

    @abstractmethod
    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target side: the ids and probs of `payload`, on the target's device."""

    def send_back(self, step_id: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TargetPayload:
        """Target side: make named `[rows, width]` tensors of the reverse layout available to the draft."""
        raise NotImplementedError(f"the {self.name} channel carries nothing back")

    def receive_back(self, payload: common_pb2.TargetPayload) -> dict[str, torch.Tensor]:
        """Draft side: the tensors of `payload`, by name, on the draft's device."""
        raise NotImplementedError(f"the {self.name} channel carries nothing back")

    def close(self) -> None:
        """Release transport resources."""

    def check_back(self, step_id: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TargetPayload:
        """A `send_back`'s tensors checked against the reverse layout; the payload that names them (no data)."""
        if self.reverse is None:
            raise ValueError(f"{self.name} channel: no reverse layout was set up, so nothing can be sent back")
        layout = {name: (width, dtype) for name, width, dtype in self.reverse.tensors}
        if not tensors:
            raise ValueError(f"{self.name} channel: send_back needs at least one tensor")
        rows = {t.shape[0] if t.dim() == 2 else -1 for t in tensors.values()}
        if len(rows) != 1 or -1 in rows:
            raise ValueError(f"{self.name} channel: send_back's tensors must be [rows, width] with one row count")
        (count,) = rows
        if count > self.reverse.max_rows:
            raise ValueError(
                f"{self.name} channel: {count} rows exceed the {self.reverse.max_rows} set up for one send_back; "
                "split them over several sends"
            )
        payload = common_pb2.TargetPayload(channel=self.name, step_id=step_id, rows=count)
        for name, tensor in tensors.items():
            if name not in layout:
                raise ValueError(f"{self.name} channel: {name!r} is not in the reverse layout ({', '.join(layout)})")
            width, dtype = layout[name]
            if tensor.shape[1] != width or tensor.dtype != dtype:
                raise ValueError(
                    f"{self.name} channel: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the layout says "
                    f"[rows, {width}] {dtype}"
                )
            payload.tensors.add(name=name, shape=tensor.shape, dtype=DTYPE_NAMES[dtype])
        return payload
