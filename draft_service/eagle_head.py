"""EAGLE-1 and EAGLE-3 draft heads: their modules, their keys and values per sequence slot, and their loading from
the published checkpoints.

Layer numbering: the layers a head reads are indices into Hugging Face's `output_hidden_states` of the target (0: the
embeddings, j: the output of decoder layer j - 1), as vLLM numbers `eagle_aux_hidden_state_layer_ids` (SGLang adds
one to the ids a config names). EAGLE-3's default is (2, N // 2, N - 3) for a target of N layers; EAGLE-1 reads the
target's last hidden state after its final norm (what its LM head sees)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from minedraft.errors import ModelLoadError


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@dataclass(frozen=True)
class SlotRun:
    """One batched forward over `HeadCache` slots: row b's query i sits at rotary position `positions[b, i]`, writes
    its key and value at index `limits[b, i]` of slot `slots[b]` and sees that slot's keys up to there (its own
    included). `length`: the keys read per row (the largest valid limit + 1); `valid`: the flat indices (b * n + i)
    of the real queries when shorter rows are padded, None when every query is real."""

    slots: torch.Tensor  # [B]
    positions: torch.Tensor  # [B, n]
    limits: torch.Tensor  # [B, n]
    length: int
    valid: torch.Tensor | None = None


class HeadCache:
    """The head's keys and values, one slot of positions per held sequence: [slots, kv_heads, capacity, head_dim].
    Zeros at first: a masked key's score is dropped, but its value still meets a zero weight, so it must be finite.
    Grows by doubling as sequences lengthen, to `limit` at most where a doubling would pass it (and further only as
    far as asked): a target's max_model_len (128K for Llama 3.1) reserved for every slot up front would dwarf the
    head itself."""

    def __init__(
        self,
        num_slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int,
        limit: int | None = None,
    ) -> None:
        self.keys = torch.zeros(num_slots, kv_heads, max(1, capacity), head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.limit = limit

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    def reserve(self, length: int) -> None:
        """Room for `length` keys in every slot."""
        if length <= self.capacity:
            return
        doubled = 2 * self.capacity if self.limit is None else min(2 * self.capacity, self.limit)
        capacity = max(length, doubled)
        grown = []
        for old in (self.keys, self.values):
            new = old.new_zeros(old.shape[0], old.shape[1], capacity, old.shape[3])
            new[:, :, : old.shape[2]] = old
            grown.append(new)
        self.keys, self.values = grown


class HeadAttention(nn.Module):
    """A Llama attention whose projections take `input_width` features (EAGLE-3: 2H, the embeddings beside the
    hidden state); keys and values of earlier positions are passed in (`forward`, one sequence) or kept in a
    `HeadCache` (`forward_slots`, a batch)."""

    def __init__(self, config: LlamaConfig, input_width: int) -> None:
        super().__init__()
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(input_width, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_width, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_width, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [..., heads, n, d], keys and values [..., kv_heads, n, d] of `x` [..., n, width], rotated."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.heads, self.head_dim).transpose(-3, -2)
        k = self.k_proj(x).view(*lead, self.kv_heads, self.head_dim).transpose(-3, -2)
        v = self.v_proj(x).view(*lead, self.kv_heads, self.head_dim).transpose(-3, -2)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`x` [n, width] of one sequence's new positions (after `past`'s [kv_heads, m, d] keys and values):
        the attention's output [n, H] and the keys and values up to the new positions."""
        n = x.shape[0]
        q, k, v = self._project(x, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
        m = k.shape[1]
        # Causal over the new positions, all of the past visible.
        mask = torch.ones(n, m, dtype=torch.bool, device=x.device).tril(diagonal=m - n)
        groups = self.heads // self.kv_heads
        out = nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0), attn_mask=mask
        )
        return self.o_proj(out.transpose(0, 1).reshape(n, -1)), (k, v)

    def forward_slots(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: HeadCache, run: SlotRun
    ) -> torch.Tensor:
        """`x` [B, n, width], each row new positions of its slot (`run`): their keys and values written into
        `cache`, the attention's output [B, n, H], each query over its slot's keys up to its own."""
        batch, n = x.shape[:2]
        q, k, v = self._project(x, cos, sin)
        new_keys = k.transpose(1, 2).reshape(batch * n, self.kv_heads, self.head_dim)
        new_values = v.transpose(1, 2).reshape(batch * n, self.kv_heads, self.head_dim)
        slot_of, at = run.slots[:, None].expand(batch, n).reshape(-1), run.limits.reshape(-1)
        if run.valid is not None:
            new_keys, new_values = new_keys[run.valid], new_values[run.valid]
            slot_of, at = slot_of[run.valid], at[run.valid]
        cache.keys[slot_of, :, at] = new_keys
        cache.values[slot_of, :, at] = new_values
        # (index_select of the slice: a quarter of advanced indexing's time on a CPU)
        keys = cache.keys[:, :, : run.length].index_select(0, run.slots)
        values = cache.values[:, :, : run.length].index_select(0, run.slots)
        # Each K/V head's query heads stacked along the positions, the mask repeated (as engine.attention does): no
        # copy of the keys per query head, which with a mask SDPA's fused kernels would need.
        groups = self.heads // self.kv_heads
        stacked = q.reshape(batch, self.kv_heads, groups * n, self.head_dim)
        mask = torch.arange(run.length, device=x.device) <= run.limits[:, None, :, None]  # [B, 1, n, L]
        mask = mask.expand(batch, groups, n, run.length).reshape(batch, 1, groups * n, run.length)
        out = nn.functional.scaled_dot_product_attention(stacked, keys, values, attn_mask=mask)
        return self.o_proj(out.reshape(batch, self.heads, n, self.head_dim).transpose(1, 2).reshape(batch, n, -1))


class EagleHead(nn.Module):
    """One decoder layer over the target's features. EAGLE-1: `fc` (2H -> H) of [embedding, target hidden], then
    a Llama layer without its input norm; its output is the next hidden state and, through the target's LM head,
    the logits. EAGLE-3: the target's layers concatenated through `fc` (kH -> H) at the target's positions; the
    layer's attention reads [input_layernorm(embedding), hidden_norm(hidden)] (2H); `norm` then its own `lm_head`
    over `draft_vocab_size` ids, mapped to the target's by `d2t`; the pre-norm output is the next hidden state."""

    def __init__(self, config: LlamaConfig, eagle3: bool, fc_inputs: int, fc_bias: bool = False) -> None:
        super().__init__()
        self.eagle3 = eagle3
        hidden = config.hidden_size
        self.fc = nn.Linear(fc_inputs, hidden, bias=fc_bias)
        self.self_attn = HeadAttention(config, 2 * hidden if eagle3 else hidden)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary = LlamaRotaryEmbedding(config)
        if eagle3:
            self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
            self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
            draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            self.d2t: torch.Tensor
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.embed = nn.Embedding(1, hidden)  # the target's, set by `load_eagle_head`
        self.target_head: nn.Linear | None = None  # EAGLE-1's LM head: the target's

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The head's hidden state at the target's positions, from the layers it reads concatenated."""
        return self.fc(target_hidden) if self.eagle3 else target_hidden

    def _inputs(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's input and the residual, of each position's next token and hidden state."""
        embeds = self.embed(tokens)
        if not self.eagle3:
            x = self.fc(torch.cat([embeds, hidden], dim=-1))
            return x, x
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual

    def _finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        residual = residual + attended
        return residual + self.mlp(self.post_attention_layernorm(residual))

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One sequence's new positions: the token at each position's next (`tokens` [n]) and the hidden state at
        the position ([n, H]); returns the output hidden states [n, H] and the keys and values so far."""
        x, residual = self._inputs(tokens, hidden)
        cos, sin = self.rotary(x[None], positions[None])
        attended, kv = self.self_attn(x, cos[0].to(x.dtype), sin[0].to(x.dtype), past)
        return self._finish(residual, attended), kv

    def forward_slots(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: HeadCache, run: SlotRun) -> torch.Tensor:
        """As `forward`, for a batch: `tokens` [B, n] and `hidden` [B, n, H] of each row's new positions, laid out
        over its slot of `cache` by `run`; returns the outputs [B, n, H] (a padded query's is garbage)."""
        x, residual = self._inputs(tokens, hidden)
        cos, sin = self.rotary(x, run.positions)
        cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
        return self._finish(residual, self.self_attn.forward_slots(x, cos, sin, cache, run))

    def greedy(self, out: torch.Tensor) -> torch.Tensor:
        """The target's id of each output's largest logit, as `logits(out).argmax(-1)` without spreading EAGLE-3's
        draft vocabulary over the target's (B x 128K on a Llama 3 target): the published heads' `d2t` maps draft
        ids to target ids in increasing order, so even a tie picks the same id."""
        if not self.eagle3:
            assert self.target_head is not None
            return self.target_head(out).argmax(-1)
        best = self.lm_head(self.norm(out)).argmax(-1)
        return best + self.d2t[best]

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's ids (EAGLE-3: its draft ids' logits placed at their target ids, -inf at the
        others)."""
        if not self.eagle3:
            assert self.target_head is not None
            return self.target_head(out)
        draft = self.lm_head(self.norm(out))
        vocab = self.embed.num_embeddings
        full = draft.new_full((*draft.shape[:-1], vocab), float("-inf"))
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t
        return full.index_copy(-1, ids, draft)


@dataclass(frozen=True)
class HeadSpec:
    """What a head reads of the target: `layers`, indices into HF's `output_hidden_states` (module docstring)."""

    eagle3: bool
    layers: tuple[int, ...]


def _read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory: safetensors (one file or an index) or pytorch_model.bin, as the
    published heads come."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return {k: v for file in files for k, v in load_file(os.path.join(path, file)).items()}
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return load_file(os.path.join(path, "model.safetensors"))
    if os.path.isfile(os.path.join(path, "pytorch_model.bin")):
        state: dict[str, torch.Tensor] = torch.load(
            os.path.join(path, "pytorch_model.bin"), map_location="cpu", weights_only=True
        )
        return state
    raise ModelLoadError(f"{path!r} holds no checkpoint (model.safetensors, its index or pytorch_model.bin)")


def _target_tensors(path: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The target's input embeddings, its LM head (the embeddings where tied) and its config, without loading its
    other weights."""
    from transformers import AutoConfig

    from minedraft.engine.models import _safetensors_files

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    files = _safetensors_files(path)
    from safetensors import safe_open

    def read(key: str) -> torch.Tensor | None:
        if key not in files:
            return None
        with safe_open(files[key], framework="pt") as f:
            return f.get_tensor(key)

    embed = read("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"the target checkpoint {path!r} has no model.embed_tokens.weight for the head")
    head = read("lm_head.weight")
    return embed, embed if head is None else head, config


def head_spec(config: dict[str, Any], eagle3: bool, target_layers: int) -> HeadSpec:
    """The layers a head reads (module docstring)."""
    if not eagle3:
        return HeadSpec(False, (target_layers,))
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    layers = tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)
    if any(not 0 <= i <= target_layers for i in layers):
        raise ModelLoadError(f"the head reads target layers {layers}, but the target has {target_layers} layers")
    return HeadSpec(True, layers)


def load_eagle_head(
    head_dir: str, target_dir: str, eagle3: bool, dtype: torch.dtype = torch.float32
) -> tuple[EagleHead, HeadSpec]:
    """A head from its published checkpoint (EAGLE-1: `fc.*` and `layers.0.*`; EAGLE-3: `midlayer.*`, `fc`, `norm`,
    `lm_head`, `d2t`), with the target's embeddings (and for EAGLE-1 its LM head) from `target_dir`."""
    with open(os.path.join(head_dir, "config.json")) as f:
        raw = json.load(f)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    state = _read_checkpoint(head_dir)
    embed, target_head, target_config = _target_tensors(target_dir)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    spec = head_spec(raw, eagle3, int(text.num_hidden_layers))
    prefix = "midlayer." if eagle3 else "layers.0."
    renamed: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        if key.startswith(prefix):
            renamed[key[len(prefix) :]] = value
        elif key in ("fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t"):
            renamed[key] = value
    fc = renamed.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"{head_dir!r} has no fc.weight: not an EAGLE{'-3' if eagle3 else ''} head")
    head = EagleHead(config, eagle3, fc_inputs=int(fc.shape[1]), fc_bias="fc.bias" in renamed)
    head.embed = nn.Embedding.from_pretrained(embed.float())
    if not eagle3:
        head.target_head = nn.Linear(target_head.shape[1], target_head.shape[0], bias=False)
        head.target_head.weight.data = target_head.float()
    expected = {k for k in head.state_dict() if not k.startswith(("embed.", "target_head.", "rotary."))}
    missing = expected - set(renamed)
    if missing:
        raise ModelLoadError(f"the head checkpoint {head_dir!r} lacks {sorted(missing)[:4]}")
    head.load_state_dict(renamed, strict=False)
    if eagle3 and len(spec.layers) * text.hidden_size != fc.shape[1]:
        raise ModelLoadError(f"fc takes {fc.shape[1]} features, not {len(spec.layers)} target layers' worth")
    return head.to(dtype).eval().requires_grad_(False), spec
