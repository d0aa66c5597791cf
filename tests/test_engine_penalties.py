"""Penalties, min_tokens, min_p and logprobs through the engine equal the target alone, drafted or not."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from conftest import hf_processed_greedy
from transformers import PreTrainedModel

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from minedraft_app.offline import OfflineRequest, generate_offline
from target_service.verifier import StepResult, Verifier

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 128
MAX_BATCH = 4
CACHE_LEN = 96


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in (3, 9, 17, 30, 5, 12)]


PROMPTS = _prompts()
MAX_TOKENS = 20


def _hf(model: PreTrainedModel, prompt: list[int], config: SamplingConfig, eos: int | None) -> list[int]:
    return hf_processed_greedy(model, prompt, config, [] if eos is None else [eos])


def _run(
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    configs: list[SamplingConfig],
    k: int,
    eos: list[int],
    steps: list[tuple[list[int], StepResult]] | None = None,
    all_accepted: bool = False,
) -> list[list[int]]:
    verifier = Verifier(ModelRunner(target, MAX_BATCH, CACHE_LEN), eos)
    proposer = None if draft is None else Proposer(ModelRunner(draft, MAX_BATCH, CACHE_LEN), eos_token_ids=eos)
    if steps is not None:  # every step's result, to read its logprobs after
        verify, prefill = verifier.verify, verifier.prefill

        def recording_verify(seq_ids: list[int], *args: Any, **kwargs: Any) -> StepResult:
            steps.append((list(seq_ids), verify(seq_ids, *args, **kwargs)))
            return steps[-1][1]

        def recording_prefill(seq_ids: list[int], *args: Any, **kwargs: Any) -> StepResult:
            steps.append((list(seq_ids), prefill(seq_ids, *args, **kwargs)))
            return steps[-1][1]

        verifier.verify = recording_verify  # type: ignore[method-assign,assignment]
        verifier.prefill = recording_prefill  # type: ignore[method-assign,assignment]
    requests = [OfflineRequest(list(p), c, arrival_step=i // 2) for i, (p, c) in enumerate(zip(PROMPTS, configs))]
    results = generate_offline(verifier, proposer, requests, k, MAX_BATCH)
    assert verifier.runner.free_slots == MAX_BATCH
    if all_accepted:  # a draft penalized as the target is accepted at every position
        assert all(r.accepted == k * r.steps for r in results), [(r.accepted, r.steps) for r in results]
    return [r.tokens for r in results]


PENALTIES = {
    "repetition": {"repetition_penalty": 1.8},
    "repetition-below-1": {"repetition_penalty": 0.6},
    "presence": {"presence_penalty": 1.5},
    "frequency": {"frequency_penalty": 0.7},
    "presence-frequency": {"presence_penalty": -0.5, "frequency_penalty": 1.2},
    "min_tokens": {"min_tokens": 12},
    "min_p": {"min_p": 0.3},
    "logit_bias": {"logit_bias": ((5, 6.0), (11, 3.0), (40, -100.0))},
}


@pytest.fixture(scope="module")
def early_eos(tiny_models) -> tuple[int, list[list[int]]]:
    """An EOS the Llama target does emit early, so that min_tokens has something to hold back, and HF's greedy
    output of PROMPTS with it, unpenalized."""
    target = tiny_models.target("llama", vocab=VOCAB)
    plain = [_hf(target, p, SamplingConfig(max_tokens=MAX_TOKENS), None) for p in PROMPTS]
    eos = max(range(VOCAB), key=lambda t: sum(tokens[:8].count(t) for tokens in plain))
    return eos, [_hf(target, p, SamplingConfig(max_tokens=MAX_TOKENS), eos) for p in PROMPTS]


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("mode", ["ar", "sd", "self"])
def test_penalized_greedy_matches_hf(
    penalty: str, mode: str, tiny_models, early_eos: tuple[int, list[list[int]]]
) -> None:
    """Each penalty alone, greedy: the tokens of HF `generate()` with the same logits processor, the target alone,
    drafted by a noisy copy of the target and by the target itself (every draft accepted: the draft penalizes as the
    target does, and the penalties of both count the drafts before each position)."""
    target = tiny_models.target("llama", vocab=VOCAB)
    draft = {"ar": None, "sd": tiny_models.noisy_draft("llama", vocab=VOCAB), "self": target}[mode]
    eos, unpenalized = early_eos
    configs = [SamplingConfig(max_tokens=MAX_TOKENS, **PENALTIES[penalty]) for _ in PROMPTS]  # type: ignore[arg-type]
    expected = [_hf(target, p, c, eos) for p, c in zip(PROMPTS, configs)]
    if penalty != "min_p":  # (greedy min_p keeps the argmax: nothing to see but that it runs)
        assert expected != unpenalized, "the penalty changes nothing here: the test would not see it"
    assert _run(target, draft, configs, k=3, eos=[eos], all_accepted=mode == "self") == expected


def _logprobs_of(steps: list[tuple[list[int], StepResult]]) -> list[list[tuple[float, list]]]:
    """Each sequence's reported logprobs, in order, from the steps' results (read after their tokens)."""
    per_seq: dict[int, list[tuple[float, list]]] = {}
    for seq_ids, step in steps:
        for seq, row in zip(seq_ids, step.logprobs_per_row()):
            assert row is not None
            per_seq.setdefault(seq, []).extend(row)
    return [per_seq[i] for i in sorted(per_seq)]


@pytest.mark.parametrize("penalized", [False, True])
def test_logprobs_equal_target_alone(penalized: bool, tiny_models) -> None:
    """The reported log-probabilities, drafted positions included, equal the target alone's within 1e-5; without
    penalties, log_softmax of the HF model's own logits over the generated sequence."""
    target = tiny_models.target("llama", vocab=VOCAB)
    extra = {"repetition_penalty": 1.3, "frequency_penalty": 0.4} if penalized else {}
    configs = [
        SamplingConfig(max_tokens=MAX_TOKENS, logprobs=(0, 5, 20)[i % 3], temperature=0.0, **extra)  # type: ignore[arg-type]
        for i in range(len(PROMPTS))
    ]
    reported = {}
    for mode, draft in (("ar", None), ("sd", tiny_models.noisy_draft("llama", vocab=VOCAB)), ("self", target)):
        steps: list[tuple[list[int], StepResult]] = []
        tokens = _run(target, draft, configs, k=3, eos=[], steps=steps)
        reported[mode] = (tokens, _logprobs_of(steps))
    ar_tokens, ar_logprobs = reported["ar"]
    for mode in ("sd", "self"):
        tokens, logprobs = reported[mode]
        assert tokens == ar_tokens
        for config, got, want in zip(configs, logprobs, ar_logprobs):
            assert len(got) == len(want) == MAX_TOKENS
            for (lp, top), (lp_ar, top_ar) in zip(got, want):
                assert abs(lp - lp_ar) < 1e-5
                assert len(top) == config.logprobs
                assert [i for i, _ in top] == [i for i, _ in top_ar]
                assert all(abs(a - b) < 1e-5 for (_, a), (_, b) in zip(top, top_ar))
    if penalized:
        return
    for prompt, generated, reports in zip(PROMPTS, ar_tokens, ar_logprobs):
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].float()
        expected = logits.log_softmax(-1)
        chosen = expected.gather(-1, torch.tensor(generated)[:, None])[:, 0]
        assert torch.allclose(torch.tensor([lp for lp, _ in reports]), chosen, atol=1e-5)
        for j, (_, top) in enumerate(reports):
            for token, value in top:
                assert abs(expected[j, token].item() - value) < 1e-5
            if top:
                assert top[0][0] == generated[j]  # greedy: the chosen token is the most likely


@pytest.mark.parametrize("penalty", ["presence-frequency", "min_tokens"])
def test_output_prefilled_again_counts_as_output(
    penalty: str, tiny_models, early_eos: tuple[int, list[list[int]]]
) -> None:
    """A sequence prefilled again with its output so far (after a preemption: `SequenceSpec.output_tokens`) goes on
    as if it had never stopped: the penalties and min_tokens count that output as output, not prompt."""
    target = tiny_models.target("llama", vocab=VOCAB)
    eos = early_eos[0]
    configs = [SamplingConfig(max_tokens=MAX_TOKENS, **PENALTIES[penalty]) for _ in PROMPTS]  # type: ignore[arg-type]
    whole = [_hf(target, p, c, eos) for p, c in zip(PROMPTS, configs)]
    done = 10
    resumed = [
        (p + w[:done], dataclasses.replace(c, max_tokens=MAX_TOKENS - done, output_tokens=done))
        for p, c, w in zip(PROMPTS, configs, whole)
        if len(w) > done
    ]
    verifier = Verifier(ModelRunner(target, MAX_BATCH, CACHE_LEN), [eos])
    proposer = Proposer(ModelRunner(tiny_models.noisy_draft("llama", vocab=VOCAB), MAX_BATCH, CACHE_LEN), False, [eos])
    requests = [OfflineRequest(p, c) for p, c in resumed]
    results = generate_offline(verifier, proposer, requests, 3, MAX_BATCH)
    assert [r.tokens for r in results] == [w[done:] for w in whole if len(w) > done]
