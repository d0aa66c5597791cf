"""Loading Hugging Face causal LMs and tokenizers (directories, GGUF files), and checking a draft fits a target."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from minedraft.engine.tensor_parallel import TensorParallel, planned_splits, shard_index, shard_model
from minedraft.errors import ModelLoadError

if TYPE_CHECKING:  # transformers' model code takes seconds to import; the coordinator needs only tokenizers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

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
    this rank's shard of it (`minedraft.engine.tensor_parallel`), read alone from the checkpoint (`load_shard`), or
    where that cannot be, cut on the host from the whole model before it moves to `device`.

    A model larger than one GPU runs tensor parallel (`--tensor-parallel-size`), not spread layer by layer over a
    list of devices (transformers' device_map: one GPU working at a time, and `accelerate` needed)."""
    from transformers import AutoModelForCausalLM

    if "," in device:
        raise ModelLoadError(
            f"--device {device!r} lists several devices: a model over several GPUs runs tensor parallel, e.g. "
            "--device cuda:0 --tensor-parallel-size 2 (its ranks on cuda:0 and cuda:1)"
        )
    where = gguf_file(path)
    if where is None and not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    torch_dtype = resolve_dtype(dtype, device)
    if tensor_parallel is not None and tensor_parallel.size > 1 and where is None:
        try:
            model = load_shard(path, torch_dtype, device, tensor_parallel)
        except WholeModel as why:
            log.warning("rank %d loads the whole model, then cuts its shard: %s", tensor_parallel.rank, why)
        else:
            return model
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where[0] if where else path,
            gguf_file=where[1] if where else None,
            dtype=torch_dtype,
            attn_implementation="sdpa",
            local_files_only=True,
        )
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    if tensor_parallel is not None:
        shard_model(model, tensor_parallel)
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    return model


class WholeModel(Exception):
    """Why a rank cannot read its shard alone from a checkpoint (it loads the whole model and cuts it instead)."""


def _safetensors_files(path: str) -> dict[str, str]:
    """Each tensor of the checkpoint in `path` with the safetensors file that holds it (one file, or several listed
    in model.safetensors.index.json)."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise WholeModel(f"{path!r} holds no safetensors checkpoint (model.safetensors or its index)")
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _model_keys(model: PreTrainedModel, checkpoint: list[str]) -> dict[str, str]:
    """Each checkpoint key by the model's name for it, renamed as from_pretrained renames (GPT-NeoX's `embed_out` is
    `lm_head`; a base model's keys lack the prefix); a key that needs converting, not renaming, cannot be sliced."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError as exc:  # (internals of transformers 5: their names may move)
        raise WholeModel(f"transformers' key renaming is not where this loader looks: {exc}") from exc
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    meta_state = model.state_dict()
    names: dict[str, str] = {}
    for key in checkpoint:
        try:
            renamed, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
        except (TypeError, AttributeError) as exc:  # (an internal whose signature moved)
            raise WholeModel(f"transformers' key renaming does not take this loader's call: {exc}") from exc
        if renamed not in meta_state and key in meta_state:
            renamed, converter = key, None
        if converter is not None:
            raise WholeModel(f"checkpoint tensor {key} needs converting ({converter}), not slicing")
        names.setdefault(renamed, key)
    return names


def _open(file: str) -> Any:
    """A safetensors file read with pread, so a slice reads only its bytes (through the mapped file it would count
    every page it touched in this process's memory, and a copy out of it again)."""
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", backend="pread")
    except TypeError:  # (safetensors before the pread backend: mapped)
        return safe_open(file, framework="pt")


def load_shard(path: str, dtype: torch.dtype, device: str, tp: TensorParallel) -> PreTrainedModel:
    """This rank's shard of the model in `path`, reading from the safetensors files only the rows or columns of each
    split projection that are this rank's, and the replicated parts (embeddings, LM head, norms) whole.

    The model is built on the meta device (no memory), sharded there by `shard_model` (shapes and all-reduces), then
    each parameter is read in through `shard_index`, the slicing `shard_model` itself uses. Raises `WholeModel`
    where that cannot be done exactly as from_pretrained would (then the caller takes the whole-model path)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    files = _safetensors_files(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a causal LM from {path!r}: {exc}") from exc
    if getattr(config, "quantization_config", None) is not None:
        raise WholeModel("the checkpoint is quantized")
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        raise WholeModel(f"the model cannot be built on the meta device: {exc}") from exc
    if dtype != torch.float32 and (
        getattr(model, "_keep_in_fp32_modules", None) or getattr(model, "_keep_in_fp32_modules_strict", None)
    ):
        raise WholeModel("the model keeps some modules in float32, which this loader does not plan")
    splits = planned_splits(model, tp)
    shard_model(model, tp)  # (on meta: the shapes and the all-reduces, the same cut as on a loaded model)
    keys = _model_keys(model, list(files))

    # Every parameter and persistent buffer once, with all the modules that hold it (tied: LM head and embeddings).
    owners: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        held = [*module._parameters.items()]
        held += [(a, b) for a, b in module._buffers.items() if a not in module._non_persistent_buffers_set]
        for attr, tensor in held:
            if tensor is not None:
                owners.setdefault(id(tensor), []).append(
                    (f"{module_name}.{attr}" if module_name else attr, module, attr)
                )
                tensors[id(tensor)] = tensor
    target = torch.device(device)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(_open(file)) for file in sorted(set(files.values()))}
        plan: list[tuple[int, str, tuple[slice, ...] | None]] = []  # (tensor, checkpoint key, this rank's index)
        for ident, names in owners.items():  # (all checked before any is read: a fallback costs no reading)
            found = next((name for name, _, _ in names if name in keys), None)
            if found is None:
                raise WholeModel(f"the checkpoint has no {names[0][0]}")
            key, dim = keys[found], splits.get(found)
            shape = list(handles[files[key]].get_slice(key).get_shape())
            index = None if dim is None else shard_index(shape, dim, tp)
            cut = shape if index is None else [len(range(*i.indices(n))) for i, n in zip(index, shape, strict=False)]
            cut += shape[len(cut) :]
            if cut != list(tensors[ident].shape):
                raise WholeModel(f"{key} is {shape} in the checkpoint, not {list(tensors[ident].shape)} once cut")
            plan.append((ident, key, index))
        for ident, key, index in plan:
            handle = handles[files[key]]
            part = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
            value = part.to(device=target, dtype=tensors[ident].dtype)
            if value is part and part.untyped_storage().nbytes() != part.numel() * part.element_size():
                value = part.clone(memory_format=torch.contiguous_format)  # (a view of more: keep only the part)
            shared = (
                torch.nn.Parameter(value, requires_grad=False)
                if isinstance(tensors[ident], torch.nn.Parameter)
                else value
            )
            for _, module, attr in owners[ident]:
                (module._parameters if attr in module._parameters else module._buffers)[attr] = shared
            del part, value, shared
    _initialize_buffers(model, target)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise WholeModel(f"nothing in the checkpoint or the model's init gives {', '.join(left[:3])}")
    if model.can_generate():  # (as from_pretrained: generation_config.json, else what config.json says)
        try:
            model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True, _from_auto=True)
        except OSError:
            model.generation_config = GenerationConfig.from_pretrained(
                path, config_file_name="config.json", _from_model_config=True, local_files_only=True
            )
    model.eval()
    model.requires_grad_(False)
    log.info(
        "rank %d of %d read its shard of %s alone from %d file(s)", tp.rank, tp.size, path, len(set(files.values()))
    )
    return model


def _initialize_buffers(model: PreTrainedModel, device: torch.device) -> None:
    """The non-persistent buffers (rotary inv_freq) computed as from_pretrained computes them: placed off the meta
    device, then the model's own `initialize_weights`, which skips every parameter marked loaded."""
    for param in model.parameters():
        param._is_hf_initialized = True  # type: ignore[attr-defined]
    for module in model.modules():
        for attr in module._non_persistent_buffers_set:
            buffer = module._buffers.get(attr)
            if buffer is not None and buffer.device.type == "meta":
                module._buffers[attr] = torch.empty_like(buffer, device=device)
    model.initialize_weights()


def gguf_file(path: str) -> tuple[str, str] | None:
    """(its directory, gguf_file=its name) as transformers' from_pretrained reads a GGUF file (dequantized), if
    `path` names one; None for a model directory. ModelLoadError, naming the file, where it is missing or the
    `gguf` package is (the `gguf` extra)."""
    if not path.endswith(".gguf"):
        return None
    if not os.path.isfile(path):
        raise ModelLoadError(f"GGUF file {path!r} does not exist")
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
    except ImportError as exc:
        raise ModelLoadError(
            f"{path!r} is a GGUF file, which needs the gguf package to be read: pip install 'minedraft[gguf]'"
        ) from exc
    return os.path.dirname(os.path.abspath(path)), os.path.basename(path)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory, or of a GGUF file (its vocabulary and chat template)."""
    from transformers import AutoTokenizer

    where = gguf_file(path)
    try:
        if where is not None:
            return AutoTokenizer.from_pretrained(where[0], gguf_file=where[1], local_files_only=True)
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


def checkpoint_vocab(path: str) -> tuple[VocabInfo, Any]:
    """The vocabulary of the checkpoint in `path` and its config, read without its weights: what a drafter that
    loads no model (n-gram lookup) reports, taken from the target's checkpoint."""
    import hashlib

    from transformers import AutoConfig, GenerationConfig

    if not os.path.isdir(path):
        raise ModelLoadError(f"model directory {path!r} does not exist")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read a model config from {path!r}: {exc}") from exc
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    logits_size = int(text.vocab_size)
    try:
        generation: Any = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        generation = None
    tokenizer = load_tokenizer(path)
    eos = _eos_ids((generation, config), tokenizer)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]
    return VocabInfo(logits_size, len(tokenizer), digest, eos), config


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    return _eos_ids((getattr(model, "generation_config", None), model.config), tokenizer)


def _eos_ids(sources: tuple[Any, ...], tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    """The EOS ids a generation config, a model config and a tokenizer name, together."""
    ids: list[int] = []
    for source in sources:
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
