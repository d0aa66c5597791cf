"""The demo pair shipped in minedraft/demo_models (made by scripts/train_demo_pair.py) loads and generates."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minedraft import demo_models

pytestmark = pytest.mark.skipif(
    not demo_models.available(),
    reason=(
        f"demo pair not found in {demo_models.DEMO_DIR} (missing {', '.join(demo_models.missing())}); "
        "make it with `python scripts/train_demo_pair.py`"
    ),
)


@pytest.fixture(scope="module")
def pair():
    target = AutoModelForCausalLM.from_pretrained(demo_models.TARGET_DIR, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(demo_models.DRAFT_DIR, dtype=torch.float32).eval()
    target_tok = AutoTokenizer.from_pretrained(demo_models.TARGET_DIR)
    draft_tok = AutoTokenizer.from_pretrained(demo_models.DRAFT_DIR)
    return target, draft, target_tok, draft_tok


def test_files_are_hugging_face_format() -> None:
    for d in (demo_models.TARGET_DIR, demo_models.DRAFT_DIR):
        config = json.loads((d / "config.json").read_text())
        assert config["model_type"] == "llama"
        generation = json.loads((d / "generation_config.json").read_text())
        assert generation["eos_token_id"] == config["eos_token_id"]
        assert (d / "tokenizer_config.json").is_file()


def test_pair_is_small() -> None:
    total = sum(f.stat().st_size for f in demo_models.DEMO_DIR.rglob("*") if f.is_file())
    # (the target ~12 MB, the draft ~4, the EAGLE head ~6 with its own copy of the LM head, as its format has)
    assert total < 25e6, f"demo pair and head take {total / 1e6:.1f} MB; they should stay a few MB each"


def test_loads_in_float32_and_draft_is_smaller(pair) -> None:
    target, draft, _, _ = pair
    assert target.dtype == torch.float32 and draft.dtype == torch.float32
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert n_draft < n_target
    assert target.config.vocab_size == draft.config.vocab_size


def test_tokenizers_are_identical(pair) -> None:
    target, _, target_tok, draft_tok = pair
    assert target_tok.get_vocab() == draft_tok.get_vocab()
    assert len(target_tok) == len(draft_tok) == target.config.vocab_size
    assert target_tok.eos_token == draft_tok.eos_token == "<|endoftext|>"
    assert target_tok.eos_token_id == target.config.eos_token_id == target.generation_config.eos_token_id
    code = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    ids = target_tok(code, add_special_tokens=False)["input_ids"]
    assert ids == draft_tok(code, add_special_tokens=False)["input_ids"]
    assert target_tok.decode(ids) == code  # byte-level BPE: text round-trips exactly


def test_target_generates_from_def_fib(pair) -> None:
    target, draft, tok, _ = pair
    enc = tok("def fib(n):", return_tensors="pt", add_special_tokens=False)
    for model in (target, draft):
        out = model.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.shape == (1, enc["input_ids"].shape[1] + 8)
        assert torch.equal(out[0, : enc["input_ids"].shape[1]], enc["input_ids"][0])
    assert isinstance(tok.decode(out[0]), str)
