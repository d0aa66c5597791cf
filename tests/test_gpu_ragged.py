"""On a GPU, TETRIS's ragged verify (paged kernels, CUDA graphs keyed by flattened tokens) equals the padded one.

The ragged and padded verifies of the same rows and selected drafts emit the same tokens and logprobs (float32);
replayed from graphs they equal the same steps run eagerly, bit for bit; and every ragged step shape serving ran
was run ahead by `precapture`. Skipped without CUDA. Also runs as a script on the GPU machine (`python
tests/test_gpu_ragged.py`), which may lack pytest.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from target_service.verifier import StepResult, Verifier

K = 8  # drafts a row (k + E = 4 + 4: 9 tokens a row, graphed)
SEQS = list(range(5))  # 5 rows: a batch bucket of 8, three padding rows
PROMPTS = [[(7 * s + j) % 500 for j in range(10 + 9 * s)] for s in SEQS]
STEPS = 6
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(device: str) -> PreTrainedModel:
    """A random Llama of head size 32 (the paged kernels take it), float32 so that ragged and padded compare."""
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device, torch.float32).eval()


def _drafts(model: PreTrainedModel, step: int, histories: list[list[int]]) -> torch.Tensor:
    """Step `step`'s selected drafts: the model's own next 2 greedy tokens (accepted), then random ones (almost all
    rejected); rows of 0..K, one of none and one of all, -1 past each."""
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 512, (len(SEQS), K), generator=gen)
    lengths = torch.randint(0, K + 1, (len(SEQS),), generator=gen)
    lengths[step % len(SEQS)], lengths[(step + 1) % len(SEQS)] = 0, K
    with torch.inference_mode():
        for b, history in enumerate(histories):
            context = torch.tensor([history], device=model.device)
            for j in range(2):
                ids[b, j] = model(context).logits[0, -1].argmax().item()
                context = torch.cat([context, ids[b, j].view(1, 1).to(model.device)], dim=1)
    ids[torch.arange(K)[None, :] >= lengths[:, None]] = -1
    return ids


def _serve(model: PreTrainedModel, *, ragged: bool, graphs: bool, config: SamplingConfig) -> list[StepResult]:
    """Prefill, then STEPS verifies of selected drafts, on a runner of its own."""
    verifier = Verifier(ModelRunner(model, 8, 256, cuda_graphs=graphs), [])
    verifier.ragged_verifies = ragged
    first = verifier.prefill(SEQS, PROMPTS, [config] * len(SEQS)).per_row()
    histories = [p + tokens for p, (tokens, _, _) in zip(PROMPTS, first, strict=True)]
    results = []
    for step in range(STEPS):
        result = verifier.verify(SEQS, _drafts(model, step, histories), None, selected=True)
        for history, (tokens, _, _) in zip(histories, result.per_row(), strict=True):
            history += tokens
        results.append(result)
    return results


def _rows(results: list[StepResult], accepting: bool = True) -> list[list[tuple[list[int], int, int]]]:
    """Each step's rows; `accepting`: drafts were accepted (greedy), not only rejected."""
    rows = [r.per_row() for r in results]
    assert not accepting or sum(a for step in rows for _, a, _ in step) > 0
    return rows


@needs_cuda
@pytest.mark.parametrize("name", ["greedy", "greedy-logprobs", "sampled"])
def test_ragged_verifies_equal_padded_ones_on_cuda(name: str) -> None:
    config = {
        "greedy": SamplingConfig(max_tokens=1000),
        "greedy-logprobs": SamplingConfig(max_tokens=1000, logprobs=3),
        "sampled": SamplingConfig(temperature=0.8, seed=3, max_tokens=1000),
    }[name]
    model = _model("cuda:0")
    padded = _serve(model, ragged=False, graphs=True, config=config)
    ragged = _serve(model, ragged=True, graphs=True, config=config)
    assert _rows(ragged, name != "sampled") == _rows(padded, name != "sampled")
    for p, r in zip(padded, ragged, strict=True):
        if p.logprobs is not None and r.logprobs is not None:
            for p_row, r_row in zip(p.logprobs_per_row(), r.logprobs_per_row(), strict=True):
                assert p_row is not None and r_row is not None
                for (p_chosen, p_top), (r_chosen, r_top) in zip(p_row, r_row, strict=True):
                    assert abs(p_chosen - r_chosen) < 1e-4 and [i for i, _ in p_top] == [i for i, _ in r_top]


@needs_cuda
def test_ragged_graphs_equal_eager_and_were_run_ahead() -> None:
    """Replayed ragged verifies equal eager ones bit for bit (the same padded shapes), their keys count tokens in
    multiples of the batch bucket, and `precapture` ran every one of them."""
    model = _model("cuda:0")
    config = SamplingConfig(max_tokens=1000)
    assert _rows(_serve(model, ragged=True, graphs=True, config=config)) == _rows(
        _serve(model, ragged=True, graphs=False, config=config)
    )
    verifier = Verifier(ModelRunner(model, 8, 256), [])
    verifier.selected_verifies = True
    verifier.precapture(K, max_batch=8)
    ahead = set(verifier.runner.step_keys)
    first = verifier.prefill(SEQS, PROMPTS, [config] * len(SEQS)).per_row()
    histories = [p + tokens for p, (tokens, _, _) in zip(PROMPTS, first, strict=True)]
    verifier.runner.step_keys.clear()
    for step in range(STEPS):
        result = verifier.verify(SEQS, _drafts(model, step, histories), None, selected=True)
        for history, (tokens, _, _) in zip(histories, result.per_row(), strict=True):
            history += tokens
    served = verifier.runner.step_keys
    kinds = [str(key[0]) for key in served]
    assert served, "no ragged verify ran as a graph"
    assert all("-ragged" in kind and int(kind.rsplit("ragged", 1)[1]) % 8 == 0 for kind in kinds), kinds
    assert served <= ahead, f"not run ahead: {served - ahead}"


if __name__ == "__main__":
    for kind in ("greedy", "greedy-logprobs", "sampled"):
        test_ragged_verifies_equal_padded_ones_on_cuda(kind)
        print(f"{kind}: ragged verifies equal padded ones")
    test_ragged_graphs_equal_eager_and_were_run_ahead()
    print("ragged graphs equal eager, all run ahead")
