"""Grouped SDPA gives transformers' SDPA attention for GQA steps of several tokens, with any mask."""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import repeat_kv

from minedraft.attention import grouped_sdpa_attention


class _Module(torch.nn.Module):
    num_key_value_groups = 4


def test_grouped_sdpa_equals_attention_over_repeated_kv() -> None:
    torch.manual_seed(0)
    batch, kv_heads, groups, n, length, dim = 3, 2, 4, 5, 40, 16
    query = torch.randn(batch, kv_heads * groups, n, dim)
    key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    allowed = torch.rand(batch, 1, n, length) > 0.3
    allowed[..., 0] = True  # every query sees at least one key
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)

    out, _ = grouped_sdpa_attention(_Module(), query, key, value, mask, scaling=0.25)

    reference = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    assert out.shape == (batch, n, kv_heads * groups, dim)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
