"""Compiled decoder layers that hand their last residual add on to the next layer: the model's own output, and one
kernel fewer per layer (`minedraft.engine.residual_fold`)."""

from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, PreTrainedModel

from minedraft.engine.model_runner import decoder_layers
from minedraft.engine.residual_fold import fold_residuals


def _llama(layers: int = 3) -> PreTrainedModel:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _compiled(model: PreTrainedModel, fold: bool) -> PreTrainedModel:
    """Layers compiled one by one with the final norm (as `compile_decoder_layers`), folded or as transformers has
    them."""
    layers = decoder_layers(model)
    if fold:
        assert fold_residuals(model.base_model, layers)
    else:
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
        norm = model.base_model.norm
        assert isinstance(norm, torch.nn.Module)
        norm.compile(dynamic=True)
    return model


def _kernels_per_graph(code: list[str]) -> list[int]:
    """Kernel launches in each compiled graph's `call` (inductor's C++ or Triton kernels; matmuls are extern)."""
    return [len(re.findall(r"\b(?:cpp_fused|triton)_\w+\(", graph[graph.find("def call(") :])) for graph in code]


def test_folded_layers_give_the_models_output_and_one_kernel_fewer_each() -> None:
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _llama()(ids).logits
        torch._dynamo.reset()
        plain, plain_code = run_and_get_code(lambda: _compiled(_llama(), fold=False)(ids).logits)
        torch._dynamo.reset()
        model = _compiled(_llama(), fold=True)
        folded, folded_code = run_and_get_code(lambda: model(ids).logits)
        with torch.compiler.set_stance("force_eager"):  # where the sums run moved; their arithmetic did not
            assert torch.equal(model(ids).logits, want)
    assert torch.allclose(folded, want, atol=1e-5) and torch.allclose(plain, want, atol=1e-5)
    # Layer graphs have the most kernels; the final norm's is one kernel either way (with the last add folded in).
    plain_layer, folded_layer = max(_kernels_per_graph(plain_code)), max(_kernels_per_graph(folded_code))
    assert folded_layer == plain_layer - 1, (plain_layer, folded_layer)
    assert sorted(_kernels_per_graph(folded_code))[0] == sorted(_kernels_per_graph(plain_code))[0] == 1


def test_other_layers_keep_their_own_forward() -> None:
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    layers = decoder_layers(model)
    before = [layer.forward for layer in layers]
    assert layers and not fold_residuals(model.base_model, layers)
    assert [layer.forward for layer in layers] == before
