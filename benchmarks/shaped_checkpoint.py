"""Production-shaped Llamas with random bf16 weights: in memory (`build`), or checkpoints written a tensor at a time.

    python benchmarks/shaped_checkpoint.py 70b /tmp/ckpt/target --device cuda:0

A 70B-shaped model is 141 GB in bf16: more than one H200 holds, and more host memory than `save_pretrained` of a
whole model should take. Each tensor is drawn (on `--device`: a GPU draws 141 GB in seconds), copied to the host and
written into safetensors files of at most `--shard-gib`, listed in model.safetensors.index.json, so the services load
it through `from_pretrained` or, with tensor parallelism, each rank its own rows and columns. Weights are drawn as
transformers initialises a Llama (normal, std `initializer_range`; norms one). The demo tokenizer comes along: its
ids (below 4096) are valid in the 128k vocabulary. A directory written before for the same config is kept.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

sys.path.insert(0, ".")
from minedraft.demo_models import TARGET_DIR  # noqa: E402

VOCAB = 128256
SHAPES: dict[str, dict[str, Any]] = {
    "70b": dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8
    ),
    "32b": dict(
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8
    ),
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    "68m": dict(
        hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=12
    ),
}
WRITTEN = "WRITTEN"  # a marker: the checkpoint is whole (a write cut short leaves none)


def shaped_config(shape: str, context: int = 8192) -> LlamaConfig:
    """The config of a `shape`-shaped Llama-3 (`SHAPES`) with a context of `context` tokens."""
    # transformers 5 still takes rope_theta (into rope_parameters), but LlamaConfig's typed signature lacks it.
    config = LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=context,
        rope_theta=500000.0,  # type: ignore[call-arg]
        **SHAPES[shape],
    )
    config.dtype = torch.bfloat16
    return config


def build(shape: str, device: str) -> PreTrainedModel:
    """A `shape`-shaped model (`SHAPES`) with random bf16 weights, in memory on `device`."""
    config = shaped_config(shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def write_checkpoint(config: LlamaConfig, path: Path, device: str = "cpu", shard_gib: float = 4.0) -> None:
    """A checkpoint of `config`'s Llama with random bf16 weights in `path`, one tensor in memory at a time (and at
    most `shard_gib` of them on the host), replacing whatever `path` held."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = dict(model.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight")  # (the embeddings serve both, as save_pretrained leaves it)
    shards: list[list[str]] = [[]]  # tensor names, in order, a file's worth each
    size = 0
    for name, meta in tensors.items():
        if size and size + meta.numel() * 2 > shard_gib * 2**30:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += meta.numel() * 2
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    config.save_pretrained(path)
    total = sum(t.numel() * 2 for t in tensors.values())
    generator = torch.Generator(device).manual_seed(0)
    weight_map: dict[str, str] = {}
    written, start = 0, time.perf_counter()
    for i, names in enumerate(shards):
        shard = {}
        for name in names:
            if tensors[name].dim() == 1:  # the norms
                shard[name] = torch.ones(tensors[name].shape, dtype=torch.bfloat16)
                continue
            drawn = torch.empty(tensors[name].shape, dtype=torch.bfloat16, device=device)
            shard[name] = drawn.normal_(0.0, config.initializer_range, generator=generator).cpu()
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        written += sum(t.numel() * 2 for t in shard.values())
        print(
            f"  {file}: {written / 2**30:.1f} of {total / 2**30:.1f} GiB, {time.perf_counter() - start:.0f} s",
            flush=True,
        )
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    for f in [*TARGET_DIR.glob("tokenizer*"), TARGET_DIR / "special_tokens_map.json"]:
        shutil.copy(f, path)
    (path / WRITTEN).write_text("")


def shaped_checkpoint(shape: str, path: Path, device: str = "cpu", context: int = 8192) -> Path:
    """`path`, holding a `shape`-shaped checkpoint with a context of at least `context` tokens: the one written there
    before, or a new one (`write_checkpoint`)."""
    config = shaped_config(shape, context)
    if (path / WRITTEN).exists():
        held = json.loads((path / "config.json").read_text())
        if all(held.get(k) == v for k, v in SHAPES[shape].items()) and held["max_position_embeddings"] >= context:
            print(f"{shape}-shaped checkpoint in {path}", flush=True)
            return path
    start = time.perf_counter()
    print(f"writing a {shape}-shaped checkpoint to {path}", flush=True)
    write_checkpoint(config, path, device)
    print(f"wrote a {shape}-shaped checkpoint in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path", type=Path)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--context", type=int, default=8192, help="max_position_embeddings")
    args = parser.parse_args()
    shaped_checkpoint(args.shape, args.path, args.device, args.context)


if __name__ == "__main__":
    main()
