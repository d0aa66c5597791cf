"""Fused query/key/value and gate/up projections compute what transformers' separate modules compute."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel, Qwen2Config

from minedraft.engine.fused_projections import FusedGatedMLP, FusedQKVAttention, fuse_projections

pytestmark = pytest.mark.usefixtures("single_thread")


def _model(arch: str) -> PreTrainedModel:
    torch.manual_seed(0)
    config: PretrainedConfig
    if arch == "qwen2":  # biased q/k/v projections
        config = Qwen2Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            initializer_range=0.2,
            tie_word_embeddings=False,
        )
    else:
        config = tiny_config(arch, sliding_window=6) if arch == "mistral" else tiny_config(arch)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_fused_model_gives_the_same_logits_and_generations(arch: str) -> None:
    model = _model(arch)
    assert isinstance(model, GenerationMixin)  # a causal LM: it has generate(), which the PreTrainedModel type lacks
    if arch == "qwen2":
        torch.nn.init.normal_(model.model.layers[0].self_attn.k_proj.bias, std=0.5)  # (zero-initialised)
    fused = copy.deepcopy(model)
    swapped = fuse_projections(fused)

    layers = model.config.num_hidden_layers
    attention = sum(isinstance(m, FusedQKVAttention) for m in fused.modules())
    assert swapped == attention + layers and sum(isinstance(m, FusedGatedMLP) for m in fused.modules()) == layers
    assert attention == (0 if arch == "qwen3" else layers)  # Qwen3's attention normalises q and k: left as it is
    assert fuse_projections(fused) == 0  # once
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
        # With transformers' own cache: a prefill, then one token a step.
        want = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = fused.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_projections_that_are_not_plain_linears_stay_as_they_are() -> None:
    model = _model("llama")
    attention = model.model.layers[0].self_attn

    class QuantizedLinear(torch.nn.Linear):  # stands for a quantized checkpoint's own Linear class
        pass

    quantized = QuantizedLinear(attention.k_proj.in_features, attention.k_proj.out_features, bias=False)
    attention.k_proj = quantized
    fuse_projections(model)
    assert model.model.layers[0].self_attn is attention and attention.k_proj is quantized
    assert isinstance(model.model.layers[1].self_attn, FusedQKVAttention)


def test_a_compiled_layer_rotates_and_writes_its_kv_in_one_operator() -> None:
    """The slot cache's read breaks a compiled layer's graph; the rotary embedding and the K/V write must be traced
    before the break as the one operator whose CUDA kernel does both (compiled code made three kernels of them)."""
    from minedraft.engine.model_runner import ModelRunner

    model = _model("llama")
    runner = ModelRunner(model, 4, 64)
    rows = torch.tensor(runner.allocate(2))
    runner.forward(rows, torch.ones(2, 3, dtype=torch.long), torch.full((2,), 3))  # allocates the stacked cache
    runner.cache.kernel_writes = True  # as on a GPU (a CPU writes as transformers does, at positions found once)
    graphs: list[torch.fx.GraphModule] = []

    def keep(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(graph)
        return graph.forward

    layer = model.model.layers[0]
    model.model.layers[0] = torch.compile(layer, backend=keep, dynamic=True)
    try:
        runner.forward(rows, torch.ones(2, 2, dtype=torch.long), torch.full((2,), 2))
    finally:
        model.model.layers[0] = layer
    ops = [{str(node.target) for node in graph.graph.nodes if node.op == "call_function"} for graph in graphs]
    writes = [names for names in ops if "minedraft.rotate_and_write" in names]
    assert len(graphs) > 1 and len(writes) == 1, ops  # the read's break, and the operator traced once
    assert not any("index_put" in name or "neg" in name for names in ops for name in names), ops
