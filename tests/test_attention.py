"""Grouped SDPA gives transformers' SDPA attention for GQA steps of several tokens, with any mask."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from minedraft.engine.attention import FUSED_MIN_BLOCKS, SHORT_QUERY, grouped_sdpa_attention, takes_matmuls


class _Module(torch.nn.Module):
    num_key_value_groups = 4


@pytest.mark.parametrize("n", [5, 20])  # 4 x 20 queries per K/V head: beyond SHORT_QUERY, the fused kernel
def test_grouped_sdpa_equals_attention_over_repeated_kv(n: int) -> None:
    torch.manual_seed(0)
    batch, kv_heads, groups, length, dim = 3, 2, 4, 40, 16
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


def test_short_queries_equal_sdpa() -> None:
    """Decode/verify steps (few queries per K/V head) take the matmul path; without GQA as well."""
    torch.manual_seed(1)
    for groups in (1, 4):
        module = _Module()
        module.num_key_value_groups = groups
        batch, kv_heads, n, length, dim = 2, 3, 2, 64, 8  # 6 blocks: few enough for the matmul path
        query = torch.randn(batch, kv_heads * groups, n, dim)
        key, value = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
        positions = torch.tensor([[30], [50]])[:, None, :, None] + torch.arange(n)[None, None, :, None]
        allowed = torch.arange(length)[None, None, None, :] <= positions
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)

        out, _ = grouped_sdpa_attention(module, query, key, value, mask)

        reference = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask
        ).transpose(1, 2)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_the_path_follows_queries_per_kv_head_and_blocks() -> None:
    """Short queries take the matmuls while the blocks are few; long queries and large batches the fused kernel."""
    kv_heads = 8
    few_rows, many_rows = FUSED_MIN_BLOCKS // kv_heads - 1, FUSED_MIN_BLOCKS // kv_heads
    assert takes_matmuls(few_rows, kv_heads, 4 * 5)  # an 8B verify of 4 drafts
    assert takes_matmuls(1, kv_heads, 4) and takes_matmuls(1, kv_heads, 1)  # decode with and without GQA
    assert not takes_matmuls(many_rows, kv_heads, 4 * 5)
    assert not takes_matmuls(1, kv_heads, SHORT_QUERY + 1)  # a prefill chunk
