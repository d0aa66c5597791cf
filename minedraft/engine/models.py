"""Loading Hugging Face causal LMs and tokenizers from local directories, and checking a draft fits a target."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minedraft.engine.tensor_parallel import TensorParallel, shard_model
from minedraft.errors import ModelLoadError

if TYPE_CHECKING:  # transformers' model code takes seconds to import; the coordinator needs only tokenizers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    """`auto` means bf16 on GPU and fp32 on CPU (CPU matmuls in half precision are slow and inexact)."""
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    path: str, device: str = "cpu", dtype: str | None = "auto", tensor_parallel: TensorParallel | None = None
) -> PreTrainedModel:
    """Load a causal LM from a local directory (safetensors) for inference on `device`; with `tensor_parallel`,
    this rank's shard of it (`minedraft.engine.tensor_parallel`), cut on the host before it moves to `device`.

    A model larger than one GPU runs tensor parallel (`--tensor-parallel-size`), not spread layer by layer over a
    list of devices (transformers' device_map: one GPU working at a time, and `accelerate` needed)."""
    from transformers import AutoModelForCausalLM

    if "," in device:
        raise ModelLoadError(
            f"--device {device!r} lists several devices: a model over several GPUs runs tensor parallel, e.g. "
            "--device cuda:0 --tensor-parallel-size 2 (its ranks on cuda:0 and cuda:1)"
        )
    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype, device), attn_implementation="sdpa", local_files_only=True
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    if tensor_parallel is not None:
        shard_model(model, tensor_parallel)
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from exc


@dataclass(frozen=True)
class VocabInfo:
    """What a service reports about its model's vocabulary, so a pair can be checked across processes."""

    logits_size: int  # rows of the output embedding (may be padded beyond the tokenizer)
    tokenizer_size: int
    tokenizer_hash: str
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def of(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> VocabInfo:
        import hashlib

        logits_size = int(model.get_output_embeddings().weight.shape[0])
        eos = eos_token_ids(model, tokenizer)
        if tokenizer is None:
            return VocabInfo(logits_size, logits_size, "", eos)
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        digest = hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]
        return VocabInfo(logits_size, len(tokenizer), digest, eos)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config):
        value: Any = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.extend([value] if isinstance(value, int) else list(value))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(sorted(set(ids)))


def check_pair(target: VocabInfo, draft: VocabInfo) -> None:
    """A draft may serve a target only if both tokenize identically; the draft's logits may be narrower."""
    if target.tokenizer_hash != draft.tokenizer_hash or target.tokenizer_size != draft.tokenizer_size:
        raise ModelLoadError(
            "draft and target do not share a vocabulary: target tokenizer has "
            f"{target.tokenizer_size} tokens (hash {target.tokenizer_hash}), draft has {draft.tokenizer_size} "
            f"(hash {draft.tokenizer_hash}); pick a draft from the same model family"
        )
    if draft.logits_size > target.logits_size:
        raise ModelLoadError(
            f"draft produces {draft.logits_size} logits but the target only {target.logits_size}; "
            "the draft must not propose ids the target cannot score"
        )
