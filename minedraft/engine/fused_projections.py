"""One matmul for the query, key and value projections and one for the gate and up projections of each layer.

DESIGN section 4 asks for transformers' model classes rather than model code of our own. This keeps the classes and
swaps two submodules of the Llama family only, mirroring their forward line for line and reusing transformers'
rotary embedding, attention interface and our `Cache`: a step on an H200 is bound by kernel count, and this removes
three GEMMs and their splitK reductions per layer. Every other architecture keeps its
own modules; `tests/test_fused_projections.py` pins each listed class to transformers' own output.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from minedraft.engine.kv_cache import PagedKVCache

log = logging.getLogger(__name__)

# Classes whose forward is exactly what the fused modules below compute (transformers' Llama code, which Mistral and
# Qwen2 copy; Qwen2 and Mistral also pass their sliding window on). Others keep their own modules.
ATTENTION_CLASSES = {"LlamaAttention", "MistralAttention", "Qwen2Attention"}
GATED_MLP_CLASSES = {"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"}


def concatenated(layers: list[torch.nn.Linear]) -> torch.nn.Linear:
    """A Linear whose outputs are those of `layers`, side by side."""
    weight = torch.cat([layer.weight for layer in layers])
    biases = [layer.bias for layer in layers]
    # On the meta device: the weights are about to be replaced, so none is allocated nor initialised.
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if fused.bias is not None:
        fused.bias = torch.nn.Parameter(torch.cat([b for b in biases if b is not None]), requires_grad=False)
    return fused


class FusedQKVAttention(torch.nn.Module):
    """transformers' Llama attention with the three input projections as one matmul.

    A decode or verify step is bound by reading weights and by kernel count: separate K and V projections of an 8B
    verify at batch 1 took 0.33 ms on an H200 where their bytes need 0.1 ms, and each adds a kernel or two per layer.
    """

    def __init__(self, attention: Any) -> None:  # one of ATTENTION_CLASSES
        super().__init__()
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        self.qkv_proj = concatenated([q, k, v])
        self.o_proj: torch.nn.Module = attention.o_proj
        self.splits = [q.out_features, k.out_features, v.out_features]
        self.config: Any = attention.config
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.num_key_value_groups = attention.num_key_value_groups
        self.is_causal = attention.is_causal
        self.sliding_window = getattr(attention, "sliding_window", None)
        family = sys.modules[type(attention).__module__]
        self.rotate = family.apply_rotary_pos_emb
        self.eager_attention = family.eager_attention_forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Any = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = cache if cache is not None else past_key_values  # transformers >= 5.24 renamed the argument
        input_shape = hidden_states.shape[:-1]
        projections = self.qkv_proj(hidden_states)
        cos, sin = position_embeddings
        if isinstance(cache, PagedKVCache) and cache.kernel_writes:
            # Rotated and written in one kernel, and read here: `read`'s graph break then falls in this frame.
            query = cache.rotate_and_write(
                projections, cos, sin, self.splits[0] // self.head_dim, self.splits[1] // self.head_dim, self.layer_idx
            )
            key, value = cache.read(self.layer_idx)
        else:
            query, key, value = (
                t.view(*input_shape, -1, self.head_dim).transpose(1, 2) for t in projections.split(self.splits, dim=-1)
            )
            query, key = self.rotate(query, key, cos, sin)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get(self.config._attn_implementation, self.eager_attention)
        if self.sliding_window is not None:
            kwargs["sliding_window"] = self.sliding_window
        output, weights = attend(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


class FusedGatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up as one matmul."""

    def __init__(self, mlp: Any) -> None:  # one of GATED_MLP_CLASSES
        super().__init__()
        self.gate_up_proj = concatenated([mlp.gate_proj, mlp.up_proj])
        self.down_proj: torch.nn.Module = mlp.down_proj
        self.act_fn: torch.nn.Module = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def plain_linears(module: torch.nn.Module) -> bool:
    """Whether every projection of `module` is a plain Linear (quantized ones store their weights otherwise)."""
    return all(type(child) is torch.nn.Linear for name, child in module.named_children() if name.endswith("_proj"))


def fuse_projections(model: torch.nn.Module) -> int:
    """Swap the attention and MLP modules of known classes for fused ones, in place (once); returns how many."""
    found = [
        (parent, name, type(child).__name__) for parent in model.modules() for name, child in parent.named_children()
    ]
    fused_class: dict[str, type[torch.nn.Module]] = {
        **dict.fromkeys(ATTENTION_CLASSES, FusedQKVAttention),
        **dict.fromkeys(GATED_MLP_CLASSES, FusedGatedMLP),
    }
    swapped = 0
    for parent, name, kind in found:
        fused = fused_class.get(kind)
        if fused is not None and plain_linears(getattr(parent, name)):
            # One module at a time, so that the separate weights are freed before the next copy: a model that
            # nearly fills its GPU has room for one layer's copy, not for every layer's.
            setattr(parent, name, fused(getattr(parent, name)))
            swapped += 1
    if swapped:
        log.info("fused the projections of %d modules of %s", swapped, type(model).__name__)
    return swapped
