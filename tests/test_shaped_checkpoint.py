"""`benchmarks/shaped_checkpoint.py`: a random-weight checkpoint written a tensor at a time loads as a whole model and
as a tensor-parallel rank's shard."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from minedraft.engine.models import load_model, load_tokenizer
from minedraft.engine.tensor_parallel import TensorParallel

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.shaped_checkpoint import SHAPES, shaped_config, write_checkpoint  # noqa: E402


def tiny(tied: bool) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
    )
    config.dtype = torch.bfloat16
    return config


@pytest.mark.parametrize("tied", [False, True])
def test_a_written_checkpoint_loads_whole_and_in_shards(tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "ckpt"
    write_checkpoint(tiny(tied), path, shard_gib=0.1 / 1024)  # files of 100 KiB: several
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((path / f).exists() for f in files)
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    model, info = loaded
    assert not any(info.values()), info  # no key missing, unexpected or mismatched
    weight = model.model.layers[1].mlp.up_proj.weight
    assert weight.dtype == torch.bfloat16 and 0.015 < weight.float().std().item() < 0.025
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr() or not tied
    # The services' ways in: the whole model, a rank's shard, the demo tokenizer that came along.
    whole = load_model(str(path), "cpu", "float32")
    rank = load_model(str(path), "cpu", "float32", TensorParallel(rank=1, size=2, group=None))
    full = whole.model.layers[2].self_attn.o_proj.weight  # (row-parallel: each rank its half of the columns)
    assert torch.equal(rank.model.layers[2].self_attn.o_proj.weight, full[:, full.shape[1] // 2 :])
    assert load_tokenizer(str(path)).encode("def main():")


def test_the_shapes_are_the_models_they_name() -> None:
    """Parameter counts of the shapes, as the models they stand for have them (Llama-3 8B and 70B: 8.03 and 70.6
    billion)."""
    counts = {}
    for shape in SHAPES:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(shaped_config(shape))
        counts[shape] = sum(p.numel() for p in model.parameters())
    assert counts["8b"] == pytest.approx(8.03e9, rel=0.01)
    assert counts["70b"] == pytest.approx(70.6e9, rel=0.01)
    assert counts["1b"] == pytest.approx(1.24e9, rel=0.01)
    assert 32e9 < counts["32b"] < 34e9
