"""A random EAGLE-3 head for a target checkpoint, in the published format (as `yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`).

    python benchmarks/eagle_head_checkpoint.py /tmp/ckpt/8b /tmp/ckpt/8b-eagle3 [--draft-vocab 32000] [--device cuda:0]

One Llama layer of the target's width (`midlayer.*`, attention over 2H inputs), `fc` (3H -> H) over the target's
layers (2, N/2, N-3), `norm`, an `lm_head` over `--draft-vocab` ids and `d2t` mapping them to target ids; bf16
safetensors and a config with `draft_vocab_size`, so `--speculative-method auto` serves it as EAGLE-3. Weights are
drawn as transformers initialises a Llama (normal, std `initializer_range`; norms one): its drafts are never the
target's, so benchmarks pair it with `--synthetic-acceptance`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def head_tensors(config: dict[str, Any], draft_vocab: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The head's tensors for a target of `config` (its config.json), by their published names."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    std = float(config.get("initializer_range", 0.02))
    generator = torch.Generator(device).manual_seed(seed)

    def drawn(*shape: int) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.bfloat16, device=device)
        return out.normal_(0.0, std, generator=generator).cpu()

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:draft_vocab].sort().values
    return {
        "fc.weight": drawn(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": drawn(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": drawn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": drawn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": drawn(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": drawn(inter, hidden),
        "midlayer.mlp.up_proj.weight": drawn(inter, hidden),
        "midlayer.mlp.down_proj.weight": drawn(hidden, inter),
        "midlayer.input_layernorm.weight": ones.clone(),
        "midlayer.hidden_norm.weight": ones.clone(),
        "midlayer.post_attention_layernorm.weight": ones.clone(),
        "norm.weight": ones.clone(),
        "lm_head.weight": drawn(draft_vocab, hidden),
        "d2t": ids - torch.arange(draft_vocab),
    }


def write_eagle3_head(target: Path, out: Path, draft_vocab: int = 32000, device: str = "cpu") -> Path:
    """`out`, holding a random EAGLE-3 head for the target checkpoint in `target` (replacing what it held)."""
    config = json.loads((target / "config.json").read_text())
    config = config.get("text_config", config)
    draft_vocab = min(draft_vocab, int(config["vocab_size"]))
    tensors = head_tensors(config, draft_vocab, device)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    head_config = {key: config[key] for key in keys if config.get(key) is not None}
    layers = int(config["num_hidden_layers"])
    head_config |= {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "rms_norm_eps": config.get("rms_norm_eps", 1e-5),
        "max_position_embeddings": config.get("max_position_embeddings", 8192),
        "vocab_size": config["vocab_size"],
        "draft_vocab_size": draft_vocab,
        "eagle_aux_hidden_state_layer_ids": [2, layers // 2, layers - 3],
        "torch_dtype": "bfloat16",
    }
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        if config.get(key) is not None:
            head_config[key] = config[key]
    (out / "config.json").write_text(json.dumps(head_config, indent=1) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="the target checkpoint directory")
    parser.add_argument("out", type=Path, help="where the head goes")
    parser.add_argument("--draft-vocab", type=int, default=32000, help="draft_vocab_size (the published 8B head's)")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (a GPU draws them in seconds)")
    args = parser.parse_args()
    write_eagle3_head(args.target, args.out, args.draft_vocab, args.device)
    print(f"wrote a random EAGLE-3 head for {args.target} to {args.out}", flush=True)


if __name__ == "__main__":
    main()
