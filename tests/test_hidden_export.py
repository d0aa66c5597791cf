"""The target's exported hidden states (what an EAGLE head reads) equal HF `output_hidden_states` at every prompt
position of a prefill, a cached prefix's too, and at every position a verify keeps."""

from __future__ import annotations

import torch
from conftest import TinyModels

from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from target_service.verifier import Verifier

LAYERS = (1, 2, 3)  # the embeddings' output, each layer's; 3: the last, after the final norm


def test_prefill_and_verify_export_hf_hidden_states(tiny_models: TinyModels) -> None:
    model = tiny_models.target("qwen3", layers=3)
    verifier = Verifier(ModelRunner(model, num_slots=4, max_len=128, cuda_graphs=False), eos_token_ids=[])
    verifier.export_hidden(LAYERS)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 128, (20,), generator=gen).tolist()  # a block in common: a prefix-cache hit
    prompts = [shared + [5, 6, 7], torch.randint(0, 128, (9,), generator=gen).tolist()]
    config = SamplingConfig(max_tokens=32)
    verifier.prefill([1], prompts[:1], [config]).per_row()
    result = verifier.prefill([2, 3], [prompts[0][:19] + [8], prompts[1]], [config, config])
    firsts = [tokens[0] for tokens, _, _ in result.per_row()]
    rows, counts = result.hidden_rows()
    assert counts == [20, 9]

    def hf(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return torch.cat([states[i][0] for i in LAYERS], dim=-1)

    want = torch.cat([hf(prompts[0][:19] + [8]), hf(prompts[1])])
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)

    # A verify of 3 drafts per row, the first of which is the target's own token: at least it is accepted.
    drafts = torch.tensor([[0, 1, 2], [0, 1, 2]])
    greedy = [hf_next(model, p + [f]) for p, f in zip([prompts[0][:19] + [8], prompts[1]], firsts)]
    drafts[:, 0] = torch.tensor(greedy)
    verified = verifier.verify([2, 3], drafts, None)
    emitted = verified.per_row()
    rows, counts = verified.hidden_rows()
    assert counts == [len(tokens) for tokens, _, _ in emitted] and min(counts) >= 2
    want = torch.cat(
        [
            hf(p + [f] + drafts[b].tolist())[len(p) : len(p) + n]
            for b, (p, f, n) in enumerate(zip([prompts[0][:19] + [8], prompts[1]], firsts, counts))
        ]
    )
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-4)


def hf_next(model: torch.nn.Module, tokens: list[int]) -> int:
    with torch.inference_mode():
        return int(model(torch.tensor([tokens])).logits[0, -1].argmax())


def test_layers_travel_once_each_and_join_in_the_heads_order() -> None:
    from minedraft.engine.hidden_export import (
        exported_layers,
        joined_for_head,
        layers_named,
        split_by_layer,
        tensor_names,
    )

    head_layers = (2, 3, 3)  # (2, N/2, N-3) of a 6-layer target repeats one
    sent = exported_layers(head_layers)
    assert sent == (2, 3) and layers_named(tensor_names(head_layers) + ["other"]) == sent
    rows = torch.arange(5 * 8, dtype=torch.float32).view(5, 8)  # two layers of width 4
    tensors = split_by_layer(rows, sent)
    assert list(tensors) == ["hidden.2", "hidden.3"]
    joined = joined_for_head(tensors, head_layers)
    assert torch.equal(joined, torch.cat([rows[:, :4], rows[:, 4:], rows[:, 4:]], dim=-1))


def test_a_send_past_the_buffer_keeps_each_sequences_latest_rows() -> None:
    from minedraft.engine.hidden_export import latest_rows, reverse_rows

    assert latest_rows([20, 9], 64) == [20, 9]  # they fit
    assert latest_rows([100, 10, 100], 90) == [40, 10, 40]  # equal shares, what the short one leaves to the others
    assert latest_rows([5, 7, 9], 12) == [4, 4, 4]
    assert sum(latest_rows([300] * 64, 2048)) <= 2048
    assert reverse_rows(64, 4, 131072) == 2048 and reverse_rows(1024, 4, 8192) == 5120  # not slots x max_len
