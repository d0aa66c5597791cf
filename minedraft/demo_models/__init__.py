"""The demo target/draft pair shipped with MineDraft (made by ``scripts/train_demo_pair.py``; see README.md here).

``TARGET_DIR`` and ``DRAFT_DIR`` are Hugging Face model directories (config, float16 safetensors, tokenizer) that
load with ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.float32)`` and ``AutoTokenizer.from_pretrained``.
``EAGLE_DIR`` holds an EAGLE-3 head for the target (made by ``scripts/train_demo_eagle.py``): ``minedraft serve
--draft`` takes it in place of the draft.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
TARGET_DIR = DEMO_DIR / "target"
DRAFT_DIR = DEMO_DIR / "draft"
EAGLE_DIR = DEMO_DIR / "eagle"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")


def missing() -> list[str]:
    """The files of the pair that are not there (empty when the pair is complete)."""
    return [f"{d.name}/{name}" for d in (TARGET_DIR, DRAFT_DIR) for name in REQUIRED_FILES if not (d / name).is_file()]


def available() -> bool:
    return not missing()
