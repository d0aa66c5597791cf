"""The `grpc` channel: tensors ride in the control messages as raw bytes (CPU, or no GPU path between sides)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from minedraft.channels.base import DTYPES, Channel
from minedraft.proto import common_pb2

# bf16 has no numpy dtype: its bits travel as int16 and are reinterpreted on arrival.
_WIRE = {
    torch.float32: ("float32", np.float32),
    torch.float16: ("float16", np.float16),
    torch.bfloat16: ("bfloat16", np.int16),
}
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class GrpcBytesChannel(Channel):
    name = "grpc"

    def send(self, step_id: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None) -> common_pb2.DraftPayload:
        payload = common_pb2.DraftPayload(
            channel=self.name,
            step_id=step_id,
            batch_size=draft_ids.shape[0],
            num_tokens=draft_ids.shape[1],
            token_ids=draft_ids.to(torch.int32).cpu().numpy().tobytes(),
        )
        if draft_probs is not None:
            dtype_name, _ = _WIRE[draft_probs.dtype]
            raw = draft_probs.contiguous().cpu()
            if draft_probs.dtype == torch.bfloat16:
                raw = raw.view(torch.int16)
            payload.probs = raw.numpy().tobytes()
            payload.probs_shape.extend(draft_probs.shape)
            payload.probs_dtype = dtype_name
        return payload

    def receive(self, payload: common_pb2.DraftPayload) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = np.frombuffer(payload.token_ids, dtype=np.int32).reshape(payload.batch_size, payload.num_tokens)
        draft_ids = torch.from_numpy(ids.astype(np.int64)).to(self.device)
        if not payload.probs:
            return draft_ids, None
        dtype = _TORCH[payload.probs_dtype]
        array = np.frombuffer(payload.probs, dtype=_WIRE[dtype][1]).reshape(tuple(payload.probs_shape))
        probs = torch.from_numpy(array.copy())
        if dtype == torch.bfloat16:
            probs = probs.view(torch.bfloat16)
        return draft_ids, probs.to(self.device)

    def send_back(self, step_id: int, tensors: Mapping[str, torch.Tensor]) -> common_pb2.TargetPayload:
        payload = self.check_back(step_id, tensors)
        for entry in payload.tensors:
            # Every dtype as its bytes (bf16 has no numpy dtype): exact, whatever the element type.
            entry.data = tensors[entry.name].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        return payload

    def receive_back(self, payload: common_pb2.TargetPayload) -> dict[str, torch.Tensor]:
        out = {}
        for entry in payload.tensors:
            dtype = DTYPES[entry.dtype]
            # (frombuffer refuses an empty buffer: a send of no rows)
            flat = torch.frombuffer(bytearray(entry.data), dtype=dtype) if entry.data else torch.empty(0, dtype=dtype)
            out[entry.name] = flat.reshape(tuple(entry.shape)).to(self.device)
        return out
