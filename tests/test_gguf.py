"""A GGUF file as the target: written here from the tiny Llama (gguf's writer), served, equal to the target alone."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from stack import TinyPair, TinyPairs, Workers, generate, running_coordinator, spawn, wait_all, worker_args

from minedraft.engine.models import VocabInfo, load_model, load_tokenizer
from minedraft.errors import ModelLoadError
from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]
PROMPT = "def parse(argv):\n    "


def _llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """A query or key projection's rows in llama.cpp's rotary order (its converter's; transformers undoes it)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(model_dir: Path, out: Path) -> Path:
    """The float32 Llama in `model_dir`, its byte-level BPE tokenizer and chat template, as a GGUF file."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    tokenizer: Any = load_tokenizer(str(model_dir))
    config = model.config
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float((config.rope_parameters or {}).get("rope_theta", 10000.0)))
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    special = set(tokenizer.all_special_tokens)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        weight = tensor.numpy()
        if name.endswith("q_proj.weight"):
            weight = _llama_cpp_rows(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = _llama_cpp_rows(weight, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def gguf_target(tiny_pairs: TinyPairs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tiny_pairs["llama"].target, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_a_gguf_file_loads_as_its_model_and_tokenizer(tiny_pairs: TinyPairs, gguf_target: Path) -> None:
    directory = tiny_pairs["llama"].target
    model, tokenizer = load_model(str(gguf_target), dtype="float32"), load_tokenizer(str(gguf_target))
    reference, reference_tokenizer = load_model(str(directory), dtype="float32"), load_tokenizer(str(directory))
    ids = reference_tokenizer.encode(PROMPT)
    assert tokenizer.encode(PROMPT) == ids and tokenizer.eos_token_id == reference_tokenizer.eos_token_id
    with torch.inference_mode():
        assert torch.equal(model(torch.tensor([ids])).logits, reference(torch.tensor([ids])).logits)
    # The same vocabulary: a GGUF target pairs with the directory's draft.
    assert VocabInfo.of(model, tokenizer) == VocabInfo.of(reference, reference_tokenizer)


def test_a_missing_file_or_gguf_package_is_named(
    gguf_target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelLoadError, match="GGUF file .*absent.gguf.* does not exist"):
        load_model(str(tmp_path / "absent.gguf"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # (import gguf raises ImportError)
    with pytest.raises(ModelLoadError, match=r"tiny-llama.F32.gguf.*needs the gguf package.*minedraft\[gguf\]"):
        load_tokenizer(str(gguf_target))


def test_a_gguf_target_serves_what_the_target_alone_generates(
    tiny_pairs: TinyPairs, gguf_target: Path, stack_logs: Path, hf_reference: Any
) -> None:
    """`minedraft target --model x.gguf` behind a coordinator (ar; its tokenizer read from the file too): greedy
    output equals the directory's model's own generate()."""
    from transformers import AutoModelForCausalLM

    pair = TinyPair("llama-gguf", gguf_target, tiny_pairs["llama"].draft)
    target = spawn("gguf-target", worker_args("target", gguf_target, 2), stack_logs)
    try:
        wait_all([target])
        workers = Workers(pair, target, None, 2)
        with running_coordinator(workers, stack_logs, "ar", max_batch_size=2) as coordinator:
            params = generation_pb2.SamplingParams(max_tokens=12, ignore_eos=True)
            done = asyncio.run(
                generate(coordinator.address, generation_pb2.GenerateRequest(prompt=PROMPT, params=params))
            )
    finally:
        target.stop()
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_pairs["llama"].target), dtype="float32")
    ids = load_tokenizer(str(tiny_pairs["llama"].target)).encode(PROMPT)
    assert done.token_ids == hf_reference(reference, ids, 12)
