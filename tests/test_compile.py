"""Compiled decoder layers (`--compile`) keep speculative decoding lossless and compile before serving.

Greedy output equals `generate()`; the start-up warm-up compiles every kind of step, so serving never waits for a
compile nor runs a layer uncompiled."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from minedraft_app.offline import OfflineRequest, generate_offline
from target_service.verifier import Verifier


def _llama(hidden: int, layers: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def test_compiled_layers_give_generate_output() -> None:
    target, draft = _llama(64, 2, 0), _llama(32, 1, 1)
    prompts = [
        torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        for length in (7, 19, 12)
    ]
    with torch.compiler.set_stance("force_eager"):  # the reference: the model as transformers runs it
        expected = [
            target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p) :]
            for p in prompts
        ]
    runner = ModelRunner(target, 4, 128, compile_layers=True)  # warms up
    verifier = Verifier(runner, eos_token_ids=[])
    verifier.warm_up(3)  # the acceptance and commit of verifies of 3 drafts, prefills and target-only steps
    proposer = Proposer(ModelRunner(draft, 4, 128))  # uncompiled: compiling costs minutes on a CI CPU
    # From here a kind of step or of batch that the warm-ups missed fails instead of running uncompiled.
    runner.forward_pass.unseen_step_stance = "fail_on_recompile"
    requests = [
        OfflineRequest(p, SamplingConfig(max_tokens=12, ignore_eos=True), arrival_step=i) for i, p in enumerate(prompts)
    ]  # joining mid-flight: batch sizes 1 and 2, prefills between steps
    compiled_before = counters["stats"]["unique_graphs"]

    outputs = generate_offline(verifier, proposer, requests, 3, 2)

    assert getattr(target, "_minedraft_compiled", False) and compiled_before > 0
    assert counters["stats"]["unique_graphs"] == compiled_before  # nothing compiled while serving
    assert [o.tokens for o in outputs] == [e.tolist() for e in expected]
    # Sampled and filtered batches (with the draft's probabilities), and target-only steps, at 1 and 2 rows.
    for config in (
        SamplingConfig(temperature=0.9, seed=1, max_tokens=6, ignore_eos=True),
        SamplingConfig(temperature=0.9, top_k=8, seed=2, max_tokens=6, ignore_eos=True),
    ):
        for drafter, k in ((proposer, 3), (None, 0)):
            requests = [OfflineRequest(p, config, arrival_step=i) for i, p in enumerate(prompts[:2])]
            assert [len(o.tokens) for o in generate_offline(verifier, drafter, requests, k, 2)] == [6, 6]
    # One-token steps (a draft's, an AR step's) at 1 and 2 rows were compiled too.
    for batch in (1, 2):
        rows = runner.allocate(batch)
        runner.forward(
            torch.tensor(rows),
            torch.ones(batch, 1, dtype=torch.long),
            torch.ones(batch, dtype=torch.long),
        )
        runner.release(rows)
