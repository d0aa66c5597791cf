"""The demo pair's data: the standard library's source split by path, its BPE tokenizer, token streams."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch

EOS = "<|endoftext|>"

# Directories of the stdlib that are not ordinary library code: tests, the IDE, installed packages, caches, demos,
# and generated data (codec tables in encodings/, the 750 kB string table in pydoc_data/).
SKIP_DIRS = {
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
    "pydoc_data",
    "encodings",
}
SKIP_FILE_PREFIXES = ("_sysconfigdata",)  # generated per build


# ----------------------------------------------------------------------------------------------------------------
# corpus


def stable_fraction(rel_path: str) -> float:
    """A number in [0, 1) from the path alone: the same on every machine and Python version (unlike hash())."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def collect_corpus(stdlib: Path, heldout_frac: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(relative path, text) of each stdlib .py file, sorted by path, split into (train, held-out)."""
    train: list[tuple[str, str]] = []
    heldout: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(SKIP_FILE_PREFIXES):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(stdlib).as_posix()
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            (heldout if stable_fraction(rel) < heldout_frac else train).append((rel, text))
    train.sort()
    heldout.sort()
    return train, heldout


# ----------------------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok, PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,  # code: never rewrite " ." and the like
    )


def save_tokenizer(tokenizer, model_dir: Path) -> None:
    """Save so that transformers 4.x and 5.x both load it as a fast tokenizer (5.x would write its own class name,
    `TokenizersBackend`, which 4.x does not know)."""
    tokenizer.save_pretrained(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS}
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_docs(raw_tokenizer, docs: list[tuple[str, str]]) -> list[list[int]]:
    """Token ids of each document (with the `tokenizers` object: no length warnings, no special tokens)."""
    return [enc.ids for enc in raw_tokenizer.encode_batch([text for _, text in docs], add_special_tokens=False)]


def token_stream(encoded: list[list[int]], eos_id: int) -> torch.Tensor:
    """All documents in one stream, each preceded by EOS (which doubles as BOS)."""
    flat: list[int] = []
    for ids in encoded:
        flat.append(eos_id)
        flat.extend(ids)
    return torch.tensor(flat, dtype=torch.long)


# ----------------------------------------------------------------------------------------------------------------
# evaluation prompts


def pick_prompts(encoded_heldout: list[list[int]], n_prompts: int, prompt_len: int, new_tokens: int, seed: int):
    """`n_prompts` prefixes of `prompt_len` tokens from held-out files, each with room for `new_tokens` after it."""
    rng = random.Random(seed)
    need = prompt_len + new_tokens
    eligible = [ids for ids in encoded_heldout if len(ids) >= need]
    if not eligible:
        return []
    order = list(range(len(eligible)))
    rng.shuffle(order)
    prompts = []
    for i in range(n_prompts):
        ids = eligible[order[i % len(order)]]
        start = rng.randrange(0, len(ids) - need + 1)
        prompts.append(ids[start : start + prompt_len])
    return prompts
