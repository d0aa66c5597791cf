"""The reference every lossless test compares with: Hugging Face `generate()` of the target alone, greedy."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new_tokens: int, **generate_kwargs: Any) -> list[int]:
    """`generate()` of the model alone, greedy, no EOS, explicit attention mask; `generate_kwargs` on top (a
    repetition penalty, for one)."""
    ids = torch.tensor([prompt], dtype=torch.long)
    settings: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **{**settings, **generate_kwargs})  # type: ignore[operator]
    return out[0, len(prompt) :].tolist()
