"""EAGLE-1 and EAGLE-3 draft heads: loaded from their published checkpoints, drafting from the target's hidden states.

Layer numbering: the layers a head reads are indices into Hugging Face's `output_hidden_states` of the target (0: the
embeddings, j: the output of decoder layer j - 1), as vLLM numbers `eagle_aux_hidden_state_layer_ids` (SGLang adds
one to the ids a config names). EAGLE-3's default is (2, N // 2, N - 3) for a target of N layers; EAGLE-1 reads the
target's last hidden state after its final norm (what its LM head sees)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from draft_service.drafter import Proposal, check_proposal
from minedraft.engine.sampling import SamplingConfig
from minedraft.errors import CapacityError, InvalidRequest, ModelLoadError

log = logging.getLogger(__name__)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class HeadAttention(nn.Module):
    """A Llama attention whose projections take `input_width` features (EAGLE-3: 2H, the embeddings beside the
    hidden state); keys and values of earlier positions are passed in, not cached here."""

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

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`x` [n, width] of one sequence's new positions (after `past`'s [kv_heads, m, d] keys and values):
        the attention's output [n, H] and the keys and values up to the new positions."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
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

    def forward(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One sequence's new positions: the token at each position's next (`tokens` [n]) and the hidden state at
        the position ([n, H]); returns the output hidden states [n, H] and the keys and values so far."""
        embeds = self.embed(tokens)
        if self.eagle3:
            if self.norm_before_residual:
                hidden = self.hidden_norm(hidden)
                residual = hidden
            else:
                residual, hidden = hidden, self.hidden_norm(hidden)
            x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        else:
            x = residual = self.fc(torch.cat([embeds, hidden], dim=-1))
        cos, sin = self.rotary(x[None], positions[None])
        attended, kv = self.self_attn(x, cos[0].to(x.dtype), sin[0].to(x.dtype), past)
        residual = residual + attended
        out = residual + self.mlp(self.post_attention_layernorm(residual))
        return out, kv

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


@dataclass
class HeadSequence:
    """One sequence's state in the head: its tokens, the target's features not yet run (each waits for the token
    after its position), the head's keys and values of the positions run on the target's features (`kv_len`), and
    its last proposal."""

    tokens: list[int]
    features: list[torch.Tensor] = field(default_factory=list)  # [n, H] blocks of positions kv_len ..
    kv: tuple[torch.Tensor, torch.Tensor] | None = None
    kv_len: int = 0
    last_drafts: list[int] = field(default_factory=list)
    last_out: torch.Tensor | None = None  # the head's output at position kv_len - 1


class EagleProposer:
    """The EAGLE drafter (`Drafter`): per sequence, the head's keys and values for every position whose target
    hidden state it has run, rolled back after each proposal to those (the drafted positions ran on the head's own
    hidden states). The target's hidden states come through `add_hidden` before the call that needs them: a
    prefill's, one per prompt position; a proposal's, one per position the last verify accepted, the verified
    token's included. Greedy drafts: q is one-hot (lossless, as any greedy draft)."""

    def __init__(self, head: EagleHead, spec: HeadSpec, num_slots: int) -> None:
        self.head, self.spec, self.num_slots = head, spec, num_slots
        self.device = head.fc.weight.device
        self.sequences: dict[int, HeadSequence] = {}
        self._waiting: dict[int, list[torch.Tensor]] = {}  # hidden states that came before their sequence

    @torch.inference_mode()
    def add_states(self, row_seq_ids: Sequence[int], rows: torch.Tensor, admitting: bool = False) -> None:
        """The target's hidden states as the channel brings them: rows of several sequences, each labelled with its
        sequence's id, each sequence's in position order (`admitting`: a prefill's, for sequences it admits next)."""
        order: dict[int, list[int]] = {}
        for index, seq_id in enumerate(row_seq_ids):
            order.setdefault(seq_id, []).append(index)
        self.add_hidden(list(order), [rows[torch.tensor(indices)] for indices in order.values()], admitting)

    @torch.inference_mode()
    def add_hidden(self, seq_ids: Sequence[int], hidden: Sequence[torch.Tensor], admitting: bool = False) -> None:
        """The target's hidden states [n, len(layers) * H_target] of each sequence's next positions; those of a
        sequence not held are dropped (it finished in the verify that made them), unless `admitting`."""
        for seq_id, rows in zip(seq_ids, hidden, strict=True):
            sequence = self.sequences.get(seq_id)
            if sequence is None and not admitting:
                continue
            features = self.head.features(rows.to(self.head.fc.weight.device, self.head.fc.weight.dtype))
            if sequence is None:
                self._waiting.setdefault(seq_id, []).append(features)
            else:
                sequence.features.append(features)

    @torch.inference_mode()
    def prefill(
        self, seq_ids: Sequence[int], prompts: Sequence[Sequence[int]], configs: Sequence[SamplingConfig]
    ) -> list[int]:
        held = [s for s in seq_ids if s in self.sequences]
        if held or len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest(f"sequence ids already held: {held or list(seq_ids)}")
        if len(self.sequences) + len(seq_ids) > self.num_slots:
            raise CapacityError(f"need {len(seq_ids)} sequence rows, {self.num_slots - len(self.sequences)} free")
        try:
            for seq_id, prompt in zip(seq_ids, prompts, strict=True):
                sequence = HeadSequence(list(prompt), self._waiting.pop(seq_id, []))
                count = sum(len(f) for f in sequence.features)
                if count:  # states of the prompt's last positions only (a bounded reverse buffer): the rest left out
                    sequence.kv_len = max(0, len(prompt) - count)
                self.sequences[seq_id] = sequence
                self._run_known(sequence)
        finally:
            self._waiting.clear()  # (states of a prefill that failed go with it)
        return [0] * len(seq_ids)

    def _run_known(self, sequence: HeadSequence) -> torch.Tensor | None:
        """Run the head on every position whose target feature and next token are both known; the output at the
        last of them (None when none ran)."""
        features = torch.cat(sequence.features) if sequence.features else None
        if features is None:
            return None
        runnable = min(len(features), len(sequence.tokens) - 1 - sequence.kv_len)
        if runnable <= 0:
            return None
        start = sequence.kv_len
        tokens = torch.tensor(sequence.tokens[start + 1 : start + 1 + runnable], device=self.device)
        positions = torch.arange(start, start + runnable, device=self.device)
        out, sequence.kv = self.head(tokens, features[:runnable], positions, sequence.kv)
        sequence.kv_len += runnable
        sequence.features = [features[runnable:]] if runnable < len(features) else []
        sequence.last_out = out[-1]
        return out[-1]

    def _align(self, sequence: HeadSequence) -> None:
        """The states that came are those of the sequence's last positions but its newest token's (a verify's: the
        positions it kept; a prefill's: the prompt's): positions before them that no state came for run on the
        head's own output, or, with none yet (a sequence admitted without its prompt's states: a draft back after a
        loss), are left out of the head's keys; states of positions already run are dropped."""
        count = sum(len(f) for f in sequence.features)
        start = len(sequence.tokens) - 1 - count
        if start < sequence.kv_len:
            features = torch.cat(sequence.features)[sequence.kv_len - start :]
            sequence.features = [features] if len(features) else []
        elif start > sequence.kv_len:
            if sequence.last_out is not None:
                waiting, sequence.features = sequence.features, []
                self._run_self_fed(sequence, until=start)
                sequence.features = waiting
            else:
                sequence.kv_len = start

    def _run_self_fed(self, sequence: HeadSequence, until: int | None = None) -> None:
        """Positions the target sent no hidden states for (tokens decoded while no proposal was asked for: the
        coordinator's spells without drafts, a draft back after a loss) run on the head's own last output, as its
        drafted positions do: a weaker guess, still verified by the target, and kept (no state will come for
        them)."""
        end = len(sequence.tokens) - 1 if until is None else until
        while sequence.kv_len < end and sequence.last_out is not None:
            position = sequence.kv_len
            token = torch.tensor(sequence.tokens[position + 1 : position + 2], device=self.device)
            at = torch.tensor([position], device=self.device)
            out, sequence.kv = self.head(token, sequence.last_out[None], at, sequence.kv)
            sequence.kv_len, sequence.last_out = position + 1, out[-1]

    @torch.inference_mode()
    def propose(
        self,
        seq_ids: Sequence[int],
        num_accepted: torch.Tensor,
        next_tokens: torch.Tensor,
        k: int,
        batch_id: int | None = None,
        missed: Sequence[Sequence[int]] = (),
        defer_upkeep: bool = False,
    ) -> Proposal:
        check_proposal(seq_ids, self.sequences, k)
        rows = []
        for b, (seq_id, accepted, token) in enumerate(zip(seq_ids, num_accepted.tolist(), next_tokens.tolist())):
            sequence = self.sequences[seq_id]
            sequence.tokens += sequence.last_drafts[:accepted] + (list(missed[b]) if missed else []) + [token]
            self._align(sequence)
            self._run_known(sequence)
            self._run_self_fed(sequence)
            if sequence.last_out is None:  # no state of the target yet (a draft back after a loss): any valid id
                if not sequence.last_drafts:
                    log.warning("sequence %d: no hidden states of the target yet; drafting its last token", seq_id)
                sequence.last_drafts = [sequence.tokens[-1]] * k
                rows.append(sequence.last_drafts)
                continue
            rows.append(self._chain(sequence, sequence.last_out, k))
        drafts = torch.tensor(rows, dtype=torch.long)
        return Proposal(drafts, None)

    def _chain(self, sequence: HeadSequence, out: torch.Tensor, k: int) -> list[int]:
        """k greedy drafts: each from the last output, then run on the head's own hidden state (keys and values
        kept apart from the sequence's: the next proposal drops them, as the target's states replace them)."""
        drafts = [int(self.head.logits(out).argmax())]
        kv, position = sequence.kv, sequence.kv_len
        for _ in range(k - 1):
            token, at = torch.tensor(drafts[-1:], device=self.device), torch.tensor([position], device=self.device)
            step, kv = self.head(token, out[None], at, kv)
            out, position = step[-1], position + 1
            drafts.append(int(self.head.logits(out).argmax()))
        sequence.last_drafts = drafts
        return drafts

    def release(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.sequences.pop(seq_id, None)
            self._waiting.pop(seq_id, None)

    def held_seq_ids(self) -> list[int]:
        return list(self.sequences)

    def precapture(self, k: int, max_batch: int) -> int:
        return 0  # eager: nothing to capture
