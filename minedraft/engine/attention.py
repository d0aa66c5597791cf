"""Attention for cache steps: paged reads by Triton kernels, GQA without copying K/V, short queries as matmuls."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from minedraft.engine.batch_invariant import DETERMINISTIC, fixed_split_attention
from minedraft.kernels import triton_runs

GROUPED_SDPA = "minedraft_grouped_sdpa"
# Decode and verify steps have at most this many queries per K/V head (query heads sharing it x new tokens).
SHORT_QUERY = 64
# Below this many (batch x K/V head) blocks a fused kernel leaves most of a GPU idle (an H200 has 132 SMs). Against
# 128 (compiled, one H200, side by side): at batch 16 the 1B draft's 4 steps took 7.13 ms against 8.80, the 8B verify
# 8.05 against 8.07.
FUSED_MIN_BLOCKS = 256
# The keyword a caller passes on through the model (True) when its mask shows each query exactly the keys up to its
# position (`position_ids`): no window, no padding.
CAUSAL_BY_POSITIONS = "minedraft_causal_by_positions"
# The keyword a step passes on through the model for paged reads: (block tables, the batch's rows, the new tokens'
# positions, whether the layers' sliding windows apply). The layer's K/V are then its blocks (`PagedKVCache.read`).
PAGED = "minedraft_paged"
# The keyword a ragged step passes on through the model (`ForwardPass.step_forward` with `flattened`): (each
# flattened token's slot in the rows' padded [B x n] layout (B x n: a padding token), B, n, each row's first token
# [B], its token count [B]). Its queries come as [T, heads, 1, D], one token a virtual row. With PAGED the ragged
# kernel reads them in place (`RAGGED_PAGED`); otherwise attention pads them into their rows, attends as a padded
# step does (its mask is the rows'), and takes each token's output back.
RAGGED = "minedraft_ragged"
# Whether paged ragged steps run the ragged kernel (else the padded layout; `benchmarks/ragged_verify_bench.py`
# measures both).
RAGGED_PAGED = True


def avoid_cudnn_attention(device: torch.device) -> None:
    """On a GPU, SDPA without its cuDNN backend (process-wide): cuDNN builds a new plan for every new key length, 17
    ms of CPU per attention call measured on an H200 (benchmarks/profile_step.py); the flash and efficient kernels
    take the same masks without that."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except that a masked step attends each K/V head once.

    With a mask, SDPA's fused kernels take no `enable_gqa`, so transformers repeats K/V for every query head: on a
    verify step at batch 32 that copy moves more bytes than the weights. Stacking the queries of the heads that share
    a K/V head along the sequence axis gives the same dot products over the K/V as they are. The mask repeats
    instead (a few hundred kB).
    """
    ragged = kwargs.pop(RAGGED, None)
    if ragged is not None:
        return _ragged_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, ragged, kwargs)
    paged = kwargs.get(PAGED)
    if paged is not None:
        tables, rows, positions, windowed = paged
        window = int(kwargs.get("sliding_window") or 0) if windowed else 0
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        fixed = bool(kwargs.get(DETERMINISTIC))
        out = torch.ops.minedraft.paged_attention(query, key, value, tables, rows, positions, scale, window, fixed)
        return out, None
    if kwargs.get(DETERMINISTIC):
        return _fixed_split(query, key, value, attention_mask, scaling, kwargs.get("softcap")), None
    groups = int(getattr(module, "num_key_value_groups", 1))
    if (
        attention_mask is None
        or attention_mask.shape[1] != 1
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    # Query head h reads K/V head h // groups (transformers' repeat_kv order).
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    mask = (
        attention_mask[:, :, None]
        .expand(-1, -1, groups, -1, -1)
        .reshape(attention_mask.shape[0], 1, groups * n, attention_mask.shape[-1])
    )
    if takes_matmuls(batch, kv_heads, groups * n):
        out = short_query_attention(folded, key, value, mask, scale)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None


def _ragged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    ragged: tuple[torch.Tensor, int, int, torch.Tensor, torch.Tensor],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Attention of a ragged step's T tokens (`RAGGED`) as [T, 1, heads, Dv]: paged, the ragged kernel over the
    queries [T, heads, 1, D] as they are; else padded into their rows' [B, heads, n, D] (padding queries zero, their
    outputs dropped) and attended as a padded step of B rows. The projections and MLPs cost T tokens; attention
    reads each row's keys once."""
    slots, batch, n, begins, counts = ragged
    paged = kwargs.get(PAGED)
    if paged is not None and RAGGED_PAGED:
        tables, rows, positions, windowed = paged
        window = int(kwargs.get("sliding_window") or 0) if windowed else 0
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        fixed = bool(kwargs.get(DETERMINISTIC))
        flat = torch.ops.minedraft.paged_attention(
            query[:, :, 0], key, value, tables, rows, positions, scale, window, fixed, begins, counts
        )
        return flat[:, None], None
    heads, dim = query.shape[1], query.shape[-1]
    padded = query.new_zeros(batch * n + 1, heads, dim)  # (the last slot: padding tokens')
    padded[slots] = query[:, :, 0]
    rows = padded[: batch * n].view(batch, n, heads, dim).transpose(1, 2)
    out, _ = grouped_sdpa_attention(module, rows, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    flat = out.reshape(batch * n, heads, out.shape[-1])  # [B, n, heads, Dv] row by row
    return flat[slots.clamp(max=batch * n - 1)][:, None], None


def _fixed_split(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float | None,
) -> torch.Tensor:
    """`--deterministic` attention over gathered K/V (`batch_invariant.fixed_split_attention`), whose mask is the
    step's additive `[B, 1, n, L]` one (all keys seen where there is none)."""
    if softcap:
        raise NotImplementedError("--deterministic does not cover attention logit softcapping (Gemma 2)")
    batch, _, n, dim = query.shape
    length = key.shape[2]
    mask = (
        query.new_zeros(batch, 1, n, length) if attention_mask is None else attention_mask[:, :, :, :length]
    ).expand(batch, 1, n, length)
    return fixed_split_attention(query, key, value, mask, scaling if scaling is not None else dim**-0.5)


def fused_query_tokens(config: object) -> int:
    """The fewest tokens per row whose step takes SDPA's fused kernel, as prompts' prefills do: shorter ones run the
    Triton kernels on CUDA, where each new kind (rows of queries, mask, chunks) compiles at its first use, 0.6-0.9 s
    mid-load on an H200 (a draft's first catch-ups of a few tokens)."""
    heads = int(getattr(config, "num_attention_heads", 1))
    groups = max(heads // int(getattr(config, "num_key_value_heads", None) or heads), 1)
    return SHORT_QUERY // groups + 1


def paged_kernel(specs: Sequence[object], config: object) -> bool:
    """Whether `minedraft.kernels.decode_attention` takes the attention of a model whose layers cache K/V as
    `specs` (`kv_cache.LayerSpec`): on CUDA with Triton, head sizes it supports, no attention softcap."""
    if KERNELS is None or not specs or getattr(config, "attn_logit_softcapping", None):
        return False
    return all(
        s.key_dim == s.value_dim >= 16  # type: ignore[attr-defined]
        for s in specs
    )


def takes_matmuls(batch: int, kv_heads: int, queries: int) -> bool:
    """Whether a gathered step of `queries` per K/V head runs `short_query_attention` rather than the fused kernel.

    Measured in whole compiled steps, not by `benchmarks/attention_bench.py`'s layer alone: there the fused kernel
    won for one query per K/V head (a 68M draft's layer at batch 1: 7.6 us against 10.2), but in a real step it took
    52 us a call at batch 16 where the bench gives 14, and the bench saw the 1B draft's paths
    equal at batch 16 where the step gained 19% with the matmuls.
    """
    return queries <= SHORT_QUERY and batch * kv_heads < FUSED_MIN_BLOCKS


def short_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v as two batched matmuls and a softmax in float32.

    For a few queries per head the fused kernels parallelise over (batch, head, query block) only: one block per K/V
    head at batch 1, 32 us per layer for an 8B verify on an H200 against a few us to read its K/V. Matmuls spread the
    keys over the whole GPU; compiled, the mask, scale and softmax fuse into one kernel. (8B verify with compiled
    layers on an H200: 8.4 -> 7.3 ms at batch 1, 9.3 -> 8.8 ms at batch 8.)
    """
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale + mask
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)


# Loaded here, not in the attention: compiled layers trace the attention, and an import has no business there.
def _decode_attention_kernels() -> ModuleType | None:
    if not triton_runs():
        return None
    from minedraft.kernels import decode_attention

    return decode_attention


KERNELS = _decode_attention_kernels()
AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
