"""The transports by name: the factory the services set a channel up with."""

from __future__ import annotations

import torch

from minedraft.channels.base import Channel
from minedraft.channels.grpc_bytes import GrpcBytesChannel
from minedraft.channels.local import LocalChannel


def make_channel(name: str, device: torch.device) -> Channel:
    kinds: dict[str, type[Channel]] = {c.name: c for c in (LocalChannel, GrpcBytesChannel)}
    try:  # the GPU transports need a CUDA build of torch (and CuPy for nccl on GPUs)
        from minedraft.channels.cuda_ipc import CudaIpcChannel
        from minedraft.channels.nccl import NcclChannel

        kinds.update({CudaIpcChannel.name: CudaIpcChannel, NcclChannel.name: NcclChannel})
    except ImportError:
        pass
    if name not in kinds:
        raise ValueError(f"unknown channel {name!r}; this build has {', '.join(sorted(kinds))}")
    return kinds[name](device)
