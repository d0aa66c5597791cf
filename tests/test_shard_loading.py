"""A tensor-parallel rank reads only its shard from the checkpoint, exactly the shard cut from the whole model."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from transformers import PreTrainedModel

from minedraft.engine.models import load_model
from minedraft.engine.tensor_parallel import TensorParallel, shard_model
from minedraft.errors import ModelLoadError

REPO = Path(__file__).resolve().parent.parent

# Llama and Qwen3 (grouped K/V heads, Qwen3's per-head norms), GPT-NeoX (one fused Q/K/V projection interleaved by
# head, biases, and `embed_out` in the checkpoint for the model's `lm_head`).
ARCHS = ("llama", "qwen3", "gpt_neox")

# How a checkpoint is saved: as it is; tied embeddings over several files (model.safetensors.index.json); bf16 read
# into a float32 model.
LAYOUTS = ("plain", "tied-sharded", "bf16")

# A Llama of 248 MiB in float32 (hidden 1024, 4 layers, MLP 4096), saved in bf16: made in a process of its own, so
# the test's process does not keep it.
MAKE = """
import sys, torch
from transformers import AutoModelForCausalLM, LlamaConfig
torch.manual_seed(5)
config = LlamaConfig(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=4096, vocab_size=1024, tie_word_embeddings=False)
AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
"""

# One rank's load in a process of its own, its peak memory (max RSS) growth measured around it.
MEASURE = """
import json, sys, torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # (model code imported before the measure)
from minedraft.engine.models import load_model
from minedraft.engine.tensor_parallel import TensorParallel, shard_model
path, rank, size, how = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def status_kib(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1])
# The peak from here: imports may have peaked above what a load adds (seen in a fresh venv: growth 0).
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")
before = status_kib("VmHWM")
if how == "whole":  # what every rank did before: the whole model, then its shard cut
    model = load_model(path, dtype="float32")
    shard_model(model, TensorParallel(rank, size))
else:
    model = load_model(path, dtype="float32", tensor_parallel=TensorParallel(rank, size))
grown = status_kib("VmHWM") - before
held = sum(p.numel() * p.element_size() for p in model.parameters())
print("RESULT " + json.dumps({"grown_mib": grown / 1024, "held_mib": held / 2**20}), flush=True)
"""


def _save(tiny_models, arch: str, layout: str, directory: Path) -> None:
    if layout == "plain":  # built anew: a runner fuses the projections of the shared models in place
        build_tiny_model(arch, 0).save_pretrained(directory)
    elif layout == "tied-sharded":
        tiny_models.get(arch, 3, tie_word_embeddings=True).save_pretrained(directory, max_shard_size="40KB")
        assert (directory / "model.safetensors.index.json").is_file(), "the checkpoint is in several files"
    else:
        tiny_models.get(arch, 4).to(torch.bfloat16).save_pretrained(directory)


def _assert_same(direct: PreTrainedModel, cut: PreTrainedModel) -> None:
    """Parameter by parameter and buffer by buffer, names, shapes, dtypes and values exactly; tied ones tied."""
    ours, theirs = (
        dict(direct.named_parameters(remove_duplicate=False)),
        dict(cut.named_parameters(remove_duplicate=False)),
    )
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.dtype == theirs[name].dtype and torch.equal(param, theirs[name]), name
        assert param.is_contiguous() and not param.requires_grad, name
    assert len(dict(direct.named_parameters())) == len(dict(cut.named_parameters())), "the same parameters are tied"
    ours_b, theirs_b = dict(direct.named_buffers()), dict(cut.named_buffers())
    assert ours_b.keys() == theirs_b.keys()
    for name, buffer in ours_b.items():
        assert buffer.dtype == theirs_b[name].dtype and torch.equal(buffer, theirs_b[name]), name
    assert direct.generation_config.to_dict() == cut.generation_config.to_dict()
    assert direct._minedraft_tp == cut._minedraft_tp and not direct.training
    row_parallel = [m for m in direct.modules() if m._forward_hooks]
    assert len(row_parallel) == len([m for m in cut.modules() if m._forward_hooks]) > 0, "the same all-reduces"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_rank_reads_the_shard_cut_from_the_whole_model(
    tiny_models, arch: str, layout: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tiny_models, arch, layout, tmp_path)
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        with caplog.at_level(logging.INFO, logger="minedraft.engine.models"):
            caplog.clear()
            direct = load_model(str(tmp_path), dtype="float32", tensor_parallel=tp)
        assert f"rank {rank} of 2 read its shard of {tmp_path} alone" in caplog.text, caplog.text
        cut = load_model(str(tmp_path), dtype="float32")
        shard_model(cut, tp)
        _assert_same(direct, cut)


def test_a_checkpoint_that_cannot_be_sliced_loads_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint that is not safetensors (pytorch_model.bin) loads whole and is cut, with the reason logged."""
    model = build_tiny_model("llama", 0)  # (not a shared one: a runner fuses their projections in place)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    tp = TensorParallel(1, 2)
    with caplog.at_level(logging.WARNING, logger="minedraft.engine.models"):
        direct = load_model(str(tmp_path), dtype="float32", tensor_parallel=tp)
    assert "rank 1 loads the whole model, then cuts its shard: " in caplog.text
    assert "holds no safetensors checkpoint" in caplog.text
    cut = load_model(str(tmp_path), dtype="float32")
    shard_model(cut, tp)
    _assert_same(direct, cut)


def test_heads_that_do_not_split_are_refused_before_reading(tiny_models, tmp_path: Path) -> None:
    tiny_models.target("llama", heads=4, kv_heads=1).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="1 key/value heads, which 2 tensor-parallel ranks cannot split"):
        load_model(str(tmp_path), dtype="float32", tensor_parallel=TensorParallel(0, 2))


def _run(code: str, *args: object) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _measure(path: Path, rank: int, size: int, how: str) -> dict[str, float]:
    out = _run(MEASURE, path, rank, size, how)
    result: dict[str, float] = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
    return result


def test_a_rank_holds_about_its_shard_while_loading(tmp_path: Path) -> None:
    """A 248 MiB (float32) Llama saved in bf16 and loaded as float32: the whole-model path converts all of it before
    it cuts (its peak grows by the whole model); a rank of 2 or 4 that reads its shard grows by about the shard (the
    split projections' part and the replicated embeddings, LM head and norms) plus a few tensors being read."""
    _run(MAKE, tmp_path)
    whole_mib = (4 * (2 * 1024 * 1024 + 2 * 512 * 1024 + 3 * 4096 * 1024) + 2 * 1024 * 1024) * 4 / 2**20
    whole = _measure(tmp_path, 0, 2, "whole")
    halves = _measure(tmp_path, 1, 2, "shard")
    quarters = _measure(tmp_path, 3, 4, "shard")
    print(f"model {whole_mib:.0f} MiB; peak growth whole-then-cut {whole}, rank 1 of 2 {halves}, 3 of 4 {quarters}")
    assert whole["grown_mib"] > whole_mib, "the whole path holds the whole model at its peak"
    largest_mib = 1024 * 4096 * 4 / 2**20  # one MLP projection in float32
    for shard in (halves, quarters):
        assert shard["grown_mib"] < shard["held_mib"] + 3 * largest_mib, shard
    assert halves["grown_mib"] < 0.6 * whole["grown_mib"] and quarters["grown_mib"] < 0.75 * halves["grown_mib"]
