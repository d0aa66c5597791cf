"""Shared fixtures: tiny randomly initialised causal LMs of several architectures, built on CPU in float32."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import hf_greedy
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    RepetitionPenaltyLogitsProcessor,
)

from minedraft.engine.models import load_model
from minedraft.engine.sampling import SamplingConfig

TINY_ARCHS = ("llama", "qwen3", "mistral", "gpt2", "gpt_neox")

# One intra-op thread for the whole test process, as every service the tests start has (OMP_NUM_THREADS=1): tiny
# models gain nothing from a second thread, and on a 2-core machine whose other core is busy (a stack's services, a
# compile) OpenMP's barriers wait on a descheduled thread. Measured on the shared 2-core machine:
# test_precaptured_shapes_cover_what_serving_runs took 604 s with torch's default 2 threads, 16 s with 1. Tests whose
# subject is what several threads do ask for `default_threads`.
DEFAULT_THREADS = torch.get_num_threads()
torch.set_num_threads(1)


def tiny_config(
    arch: str,
    *,
    hidden: int = 64,
    layers: int = 2,
    vocab: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 256,
    initializer_range: float = 0.2,
    **overrides: Any,
) -> PretrainedConfig:
    """A config of `arch` with no special tokens (so nothing stops or pads unless a test says so).

    `initializer_range` 0.2 (ten times the usual) spreads the logits, so greedy choices are not near-ties that
    float32 rounding in a differently shaped batch could flip.
    """
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "initializer_range": initializer_range,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "tie_word_embeddings": False,
    }
    if arch == "gpt2":
        cfg: PretrainedConfig = GPT2Config(
            n_embd=hidden, n_layer=layers, n_head=heads, n_positions=max_positions, n_inner=2 * hidden, **common
        )
    elif arch == "gpt_neox":
        cfg = GPTNeoXConfig(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=2 * hidden,
            max_position_embeddings=max_positions,
            **common,
        )
    else:
        config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
        cfg = config_class(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            intermediate_size=2 * hidden,
            max_position_embeddings=max_positions,
            **common,
        )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build_tiny_model(arch: str, seed: int, **config: Any) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_config` under a fixed seed, in eval mode, float32, SDPA attention."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config), attn_implementation="sdpa")
    model.eval()
    model.requires_grad_(False)
    return model


def save_and_load(model: PreTrainedModel, directory: Path) -> PreTrainedModel:
    """Round-trip through `save_pretrained` and the engine's own `load_model` (the real from_pretrained path)."""
    model.save_pretrained(directory)
    return load_model(str(directory), device="cpu", dtype="float32")


class TinyModels:
    """Builds and caches tiny models for a whole test session (building is cheap, but not free on 2 cores). Each
    call hands out a copy: a `ModelRunner` fuses the projections of the model it is given, so a shared one would
    carry one test's runner into the next (a later `save_pretrained` wrote fused keys)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[tuple[Any, ...], PreTrainedModel] = {}

    def get(self, arch: str, seed: int = 0, *, from_disk: bool = False, **config: Any) -> PreTrainedModel:
        key = (arch, seed, from_disk, tuple(sorted(config.items())))
        if key not in self._cache:
            model = build_tiny_model(arch, seed, **config)
            if from_disk:
                model = save_and_load(model, self.root / f"{arch}-{seed}-{len(self._cache)}")
            # Copied with it: what a test caches per model keys on, never an id() a later copy may reuse.
            object.__setattr__(model, "tiny_key", key)
            self._cache[key] = model
        return copy.deepcopy(self._cache[key])

    def target(self, arch: str, **config: Any) -> PreTrainedModel:
        """The usual test target: hidden 64, 2 layers, vocab 128, loaded through `from_pretrained`."""
        return self.get(arch, 0, from_disk=True, **config)

    def draft(self, arch: str, **config: Any) -> PreTrainedModel:
        """An unrelated draft of the same vocabulary (hidden 32, 1 layer, another seed): low acceptance."""
        return self.get(arch, 1, **{"hidden": 32, "layers": 1, **config})

    def noisy_draft(self, arch: str, scale: float = 0.1, **config: Any) -> PreTrainedModel:
        """The target with Gaussian noise (`scale` times each tensor's spread) on every weight: it agrees with the
        target on roughly half the greedy choices, so verify steps accept some drafts and reject the rest."""
        key = ("noisy", arch, scale, tuple(sorted(config.items())))
        if key not in self._cache:
            model = self.target(arch, **config)
            gen = torch.Generator().manual_seed(7)
            with torch.no_grad():
                for param in model.parameters():
                    if param.numel() > 1:
                        spread = param.std().clamp(min=1e-3)
                        param.add_(torch.randn(param.shape, generator=gen) * scale * spread)
            object.__setattr__(model, "tiny_key", key)
            self._cache[key] = model
        return copy.deepcopy(self._cache[key])


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: tiny models on a busy 2-core machine run several times faster without thread sync.
    (The session runs on one already, see above; this keeps a test's thread count whatever runs before it.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def default_threads() -> Iterator[None]:
    """torch's default intra-op thread count for one test (bf16 matmuls whose rows depend on M with several threads,
    not with one: tests/test_batch_invariant.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(DEFAULT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    """`hf_greedy`, as a fixture so test modules need not import conftest."""
    return hf_greedy


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens (after the prompt): Hugging Face has no
    processor of its own for them."""

    def __init__(self, prompt_length: int, presence: float, frequency: float) -> None:
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        output = input_ids[:, self.prompt_length :]
        counts = torch.zeros_like(scores).scatter_add_(1, output, torch.ones_like(output, dtype=scores.dtype))
        return scores - self.presence * (counts > 0) - self.frequency * counts  # type: ignore[return-value]


class LogitBias(LogitsProcessor):
    """OpenAI's logit_bias: a value added to the logits of some token ids (before the penalties, as vLLM)."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.ids, self.values = torch.tensor(list(bias)), torch.tensor(list(bias.values()))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        biased = scores.clone()
        biased[:, self.ids] += self.values
        return biased  # type: ignore[return-value]


class GrammarMask(LogitsProcessor):
    """Structured outputs' reference: a matcher of `spec` compiled by the same engine (xgrammar) for `tokenizer`,
    moved on by each generated token, its bitmask applied by xgrammar's own `apply_token_bitmask_inplace`."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, spec: tuple[str, str, bool], prompt_length: int, eos: list[int]
    ):
        import xgrammar

        from minedraft.engine.grammar import parse

        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
        compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_grammar(parse(spec))
        self.matcher, self.prompt_length = xgrammar.GrammarMatcher(compiled), prompt_length
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        self.apply = xgrammar.apply_token_bitmask_inplace

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_length:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        self.apply(scores, self.bitmask)
        return scores


def hf_processors(
    prompt_length: int, config: SamplingConfig, eos: list[int], tokenizer: Any = None, vocab_size: int = 0
) -> LogitsProcessorList:
    """Hugging Face's logits processors that mean what `config`'s penalties, min_tokens, min_p and grammar ask
    (min_tokens holding back `eos` and the stop token ids; a grammar compiled for `tokenizer`)."""
    processors = LogitsProcessorList()
    if config.logit_bias:
        processors.append(LogitBias(dict(config.logit_bias)))
    if config.min_tokens:
        stops = eos + list(config.stop_token_ids)
        processors.append(MinNewTokensLengthLogitsProcessor(prompt_length, config.min_tokens, stops))
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.presence_penalty or config.frequency_penalty:
        processors.append(PresenceFrequency(prompt_length, config.presence_penalty, config.frequency_penalty))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p))
    if config.grammar is not None:
        processors.append(GrammarMask(tokenizer, vocab_size, config.grammar, prompt_length, eos))
    return processors


def hf_processed_greedy(
    model: PreTrainedModel, prompt: list[int], config: SamplingConfig, eos: list[int], tokenizer: Any = None
) -> list[int]:
    """Hugging Face `generate()`, greedy, with the processors of `config` (`hf_processors`; a grammar's compiled for
    `tokenizer`), up to and including the first of `eos` or the stop token ids."""
    stops = eos + list(config.stop_token_ids)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(  # type: ignore[operator]
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=config.max_tokens,
            do_sample=False,
            eos_token_id=stops or None,
            pad_token_id=0,
            logits_processor=hf_processors(len(prompt), config, eos, tokenizer, model.config.vocab_size),
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    ends = [i for i, t in enumerate(tokens) if t in stops]
    return tokens[: ends[0] + 1] if ends else tokens
