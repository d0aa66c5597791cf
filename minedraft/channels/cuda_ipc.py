"""The `cuda-ipc` channel: each direction's writer owns GPU buffer slots the reader maps once, ordered by IPC events."""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from minedraft.channels.base import Channel, ReverseLayout
from minedraft.proto import common_pb2

# Slots are used round robin. At most two proposals are unverified at once (one per batch), and a slot is only
# rewritten four proposals later, after the verify that read it has returned: no back-pressure signal is needed.
# The target's slots (target -> draft) likewise: the draft reads a verify's tensors at the batch's next Propose, and
# the target's verify that could rewrite the slot four sends later waits on the GPU for a proposal made after it.
NUM_SLOTS = 4


def _mapped(exported: tuple[Any, Any]) -> torch.Tensor:
    rebuild, args = exported
    tensor: torch.Tensor = rebuild(*args)
    return tensor


def _wait_for_writer(event: torch.cuda.Event, buffer: torch.Tensor) -> None:
    """The reader's copies out of `buffer` after the writer's event. Waited on a stream of the writer's device:
    waiting on an IPC event of another GPU crashed the driver (on a pair of H200s). A copy between GPUs runs on the
    source device's current stream and orders the destination's current stream after it, so the copies that follow
    still come after the writer's write."""
    torch.cuda.current_stream(buffer.device).wait_event(event)


class CudaIpcChannel(Channel):
    name = "cuda-ipc"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.ids: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None
        self.events: list[torch.cuda.Event] = []
        self._next_slot = 0
        # The reverse direction's slots: the target's buffers (allocated in `export_back`, mapped by `attach_back`).
        self.back: dict[str, torch.Tensor] = {}
        self.back_events: list[torch.cuda.Event] = []
        self._next_back_slot = 0

    def _require_cuda(self, side: str) -> None:
        if self.device.type != "cuda":
            raise ValueError(f"the cuda-ipc channel needs the {side} on a CUDA device; pick another --channel")

    def export(
        self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int, reverse: ReverseLayout | None = None
    ) -> bytes:
        self._require_cuda("draft")
        self.reverse = reverse
        shape = (NUM_SLOTS, max_batch_size, num_speculative_tokens)
        self.ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        # Probabilities stay float32: the ratio p/q must use the very q the draft sampled from.
        self.probs = torch.zeros(*shape, vocab_size, dtype=torch.float32, device=self.device)
        self.events = _ipc_events(self.device)
        return pickle.dumps(
            {
                "ids": reduce_tensor(self.ids),
                "probs": reduce_tensor(self.probs),
                "events": [event.ipc_handle() for event in self.events],
                "device": self.device.index or 0,
                "reverse": reverse,
            }
        )

    def attach(self, handshake: bytes) -> None:
        self._require_cuda("target")
        exported: dict[str, Any] = pickle.loads(handshake)
        self.ids = _mapped(exported["ids"])
        self.probs = _mapped(exported["probs"])
        draft_device = torch.device("cuda", exported["device"])
        self.events = [torch.cuda.Event.from_ipc_handle(draft_device, h) for h in exported["events"]]
        self.reverse = exported.get("reverse")

    def export_back(self) -> bytes:
        if self.reverse is None:
            return b""
        rows = self.reverse.max_rows
        self.back = {
            name: torch.zeros(NUM_SLOTS, rows, width, dtype=dtype, device=self.device)
            for name, width, dtype in self.reverse.tensors
        }
        self.back_events = _ipc_events(self.device)
        return pickle.dumps(
            {
                "tensors": {name: reduce_tensor(buffer) for name, buffer in self.back.items()},
                "events": [event.ipc_handle() for event in self.back_events],
                "device": self.device.index or 0,
            }
        )

    def attach_back(self, handshake: bytes) -> None:
        if not handshake:
            return
        exported: dict[str, Any] = pickle.loads(handshake)
        self.back = {name: _mapped(buffer) for name, buffer in exported["tensors"].items()}
        target_device = torch.device("cuda", exported["device"])
        self.back_events = [torch.cuda.Event.from_ipc_handle(target_device, h) for h in exported["events"]]

    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        assert self.ids is not None and self.probs is not None, "export() first"
        slot, self._next_slot = self._next_slot, (self._next_slot + 1) % NUM_SLOTS
        batch, k = draft_ids.shape
        self.ids[slot, :batch, :k].copy_(draft_ids)
        payload = common_pb2.DraftPayload(channel=self.name, step_id=step_id, slot=slot, batch_size=batch, num_tokens=k)
        if draft_probs is not None:
            self.probs[slot, :batch, :k, : draft_probs.shape[-1]].copy_(draft_probs)
            payload.probs_shape.extend(draft_probs.shape)
            payload.probs_dtype = "float32"
        self.events[slot].record(torch.cuda.current_stream(self.device))
        return payload

    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.ids is not None and self.probs is not None, "attach() first"
        slot, batch, k = payload.slot, payload.batch_size, payload.num_tokens
        _wait_for_writer(self.events[slot], self.ids)
        ids = self.ids[slot, :batch, :k].to(self.device, copy=True)
        if not payload.probs_shape:
            return ids, None
        vocab = payload.probs_shape[-1]
        return ids, self.probs[slot, :batch, :k, :vocab].to(self.device, copy=True)

    def send_back(self, step_id: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TargetPayload:
        payload = self.check_back(step_id, tensors)
        assert self.back, "export_back() first"
        slot, self._next_back_slot = self._next_back_slot, (self._next_back_slot + 1) % NUM_SLOTS
        payload.slot = slot
        for name, tensor in tensors.items():
            self.back[name][slot, : payload.rows].copy_(tensor)
        self.back_events[slot].record(torch.cuda.current_stream(self.device))
        return payload

    def receive_back(self, payload: common_pb2.TargetPayload) -> dict[str, torch.Tensor]:
        assert self.back, "attach_back() first"
        if not payload.tensors:
            return {}
        _wait_for_writer(self.back_events[payload.slot], self.back[payload.tensors[0].name])
        slot, rows = payload.slot, payload.rows
        return {e.name: self.back[e.name][slot, :rows].to(self.device, copy=True) for e in payload.tensors}

    def close(self) -> None:
        # Dropped, not kept: a mapping of the other side's buffers pins that GPU memory, even after its process died.
        self.ids = self.probs = None
        self.events, self.back, self.back_events = [], {}, []


def _ipc_events(device: torch.device) -> list[torch.cuda.Event]:
    """One interprocess event per slot, recorded once so that a first wait on it returns."""
    events = [torch.cuda.Event(interprocess=True) for _ in range(NUM_SLOTS)]
    for event in events:
        event.record(torch.cuda.current_stream(device))
    return events
