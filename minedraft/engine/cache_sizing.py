"""How many K/V blocks a worker allocates: what each token caches, probed by a forward, against its memory budget."""

from __future__ import annotations

import logging

import torch

from minedraft.engine.forward_pass import ForwardPass, StepShape
from minedraft.engine.tensor_parallel import TensorParallel, same_on_every_rank
from minedraft.errors import CapacityError

log = logging.getLogger(__name__)

# The KV cache of a worker on a CPU, by default (`--kv-cache-memory`): a laptop's share.
CPU_KV_CACHE_GIB = 1.0
# GPU memory kept out of the KV cache for what a step allocates beside it (activations, CUDA graphs' pools).
ACTIVATION_RESERVE_GIB = 2.0


def kv_cache_bytes(device: torch.device, kv_cache_memory: float | None, gpu_memory_utilization: float) -> int:
    """The bytes of K/V blocks a worker allocates: `kv_cache_memory` GiB; or on a GPU what `gpu_memory_utilization`
    of its memory leaves once this process's weights are in (never more than is free now, less a reserve for
    activations); or `CPU_KV_CACHE_GIB`."""
    if kv_cache_memory is not None:
        return int(kv_cache_memory * 2**30)
    if device.type != "cuda":
        return int(CPU_KV_CACHE_GIB * 2**30)
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    budget = min(gpu_memory_utilization * total - own, free) - ACTIVATION_RESERVE_GIB * 2**30
    return max(int(budget), 0)


@torch.inference_mode()
def allocate_cache(
    forward_pass: ForwardPass,
    scratch_row: int,
    num_slots: int,
    tensor_parallel: TensorParallel | None,
    kv_cache_memory: float | None,
    gpu_memory_utilization: float,
) -> None:
    """Probe the K/V each token caches (a forward on `scratch_row`), then allocate the blocks once, before serving:
    as many as `kv_cache_bytes` holds, no more than `num_slots` rows could ever use; lowers the cache's `max_len`
    (with a log line) where one sequence would not fit."""
    cache, device = forward_pass.cache, forward_pass.device
    cache.probe()
    try:
        cache.lengths[scratch_row] = 0
        rows = torch.full((1,), scratch_row, dtype=torch.long, device=device)
        ids = torch.zeros(1, 1, dtype=torch.long, device=device)
        forward_pass.step_forward(rows, ids, torch.ones(1, dtype=torch.long, device=device), shape=StepShape(1, 1))
    finally:
        cache.end_probe()
    cache.lengths[scratch_row] = 0
    per_block = cache.bytes_per_block
    budget = kv_cache_bytes(device, kv_cache_memory, gpu_memory_utilization)
    ever_needed = num_slots * cache.max_blocks + 1  # every row at max_len, and the trash block
    # Every rank of a tensor-parallel group holds as many blocks: each then takes and frees the very same ones.
    num_blocks = same_on_every_rank(min(budget // per_block, ever_needed), tensor_parallel, device)
    if num_blocks < 2:
        raise CapacityError(
            f"{budget / 2**30:.2f} GiB of KV cache holds no block of {per_block / 2**20:.1f} MiB: raise "
            "--kv-cache-memory or --gpu-memory-utilization"
        )
    cache.allocate(int(num_blocks))
    fits = (int(num_blocks) - 1) * cache.block_size
    if fits < cache.max_len:
        log.warning(
            "max_model_len lowered from %d to %d tokens: one sequence must fit the KV cache's %d blocks",
            cache.max_len,
            fits,
            num_blocks - 1,
        )
        cache.max_len = fits
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB) on %s; max_model_len %d",
        num_blocks - 1,
        cache.block_size,
        (num_blocks - 1) * cache.block_size,
        num_blocks * per_block / 2**30,
        device,
        cache.max_len,
    )
