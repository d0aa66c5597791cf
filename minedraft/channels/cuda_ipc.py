"""The `cuda-ipc` channel: draft-side GPU buffer slots mapped once by the target, ordered by IPC events."""

from __future__ import annotations

import pickle
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from minedraft.channels.base import Channel
from minedraft.proto import common_pb2

# Slots are used round robin. At most two proposals are unverified at once (one per batch), and a slot is only
# rewritten four proposals later, after the verify that read it has returned: no back-pressure signal is needed.
NUM_SLOTS = 4


class CudaIpcChannel(Channel):
    name = "cuda-ipc"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.ids: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None
        self.events: list[torch.cuda.Event] = []
        self._next_slot = 0

    def export(self, num_speculative_tokens: int, max_batch_size: int, vocab_size: int) -> bytes:
        if self.device.type != "cuda":
            raise ValueError("the cuda-ipc channel needs the draft on a CUDA device")
        shape = (NUM_SLOTS, max_batch_size, num_speculative_tokens)
        self.ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        # Probabilities stay float32: the ratio p/q must use the very q the draft sampled from.
        self.probs = torch.zeros(*shape, vocab_size, dtype=torch.float32, device=self.device)
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(NUM_SLOTS)]
        for event in self.events:
            event.record(torch.cuda.current_stream(self.device))
        return pickle.dumps(
            {
                "ids": reduce_tensor(self.ids),
                "probs": reduce_tensor(self.probs),
                "events": [event.ipc_handle() for event in self.events],
                "device": self.device.index or 0,
            }
        )

    def attach(self, handshake: bytes) -> None:
        if self.device.type != "cuda":
            raise ValueError("the cuda-ipc channel needs the target on a CUDA device")
        exported: dict[str, Any] = pickle.loads(handshake)
        rebuild, args = exported["ids"]
        self.ids = rebuild(*args)
        rebuild, args = exported["probs"]
        self.probs = rebuild(*args)
        draft_device = torch.device("cuda", exported["device"])
        self.events = [torch.cuda.Event.from_ipc_handle(draft_device, h) for h in exported["events"]]

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
        # Wait on a stream of the draft's device: waiting on an IPC event of another GPU crashed the driver (on a pair
        # of H200s). A copy between GPUs runs on the source device's current stream and orders the destination's
        # current stream after it, so the copies below still follow the draft's write.
        torch.cuda.current_stream(self.ids.device).wait_event(self.events[slot])
        ids = self.ids[slot, :batch, :k].to(self.device, copy=True)
        if not payload.probs_shape:
            return ids, None
        vocab = payload.probs_shape[-1]
        return ids, self.probs[slot, :batch, :k, :vocab].to(self.device, copy=True)
