"""Grouped-query attention through SDPA without copying K/V once per query head, for steps of several tokens."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GROUPED_SDPA = "minedraft_grouped_sdpa"


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
    """transformers' SDPA attention, except that a masked GQA step attends each K/V head once.

    With a mask, SDPA's fused kernels take no `enable_gqa`, so transformers repeats K/V for every query head: on a
    verify step at batch 32 that copy moves more bytes than the weights. Stacking the queries of the heads that share
    a K/V head along the sequence axis gives the same dot products over the K/V as they are. The mask repeats
    instead (a few hundred kB).
    """
    groups = int(getattr(module, "num_key_value_groups", 1))
    if (
        attention_mask is None or groups == 1 or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)
    batch, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    # Query head h reads K/V head h // groups (transformers' repeat_kv order).
    folded = query.reshape(batch, kv_heads, groups * n, dim)
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(
        attention_mask.shape[0], 1, groups * n, attention_mask.shape[-1]
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, n, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
