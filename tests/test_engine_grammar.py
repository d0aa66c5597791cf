"""Structured outputs in the engine: the masks follow the drafts, and sampled output keeps the masked target's
distribution, from the rejection sampler's one decision to whole outputs with drafts that know nothing of the
grammar."""

from __future__ import annotations

import collections
import json
import re
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from draft_service.proposer import Proposer
from minedraft.engine.grammar import Grammars, allowed, masked_logits
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.models import load_tokenizer
from minedraft.engine.sampling import SamplingConfig, seed_key
from minedraft_app.offline import OfflineRequest, generate_offline
from target_service.rejection_sampler import RowParams, rejection_sample
from target_service.verifier import FINISHED_STOP, Verifier

pytestmark = pytest.mark.usefixtures("single_thread")

DEMO = "minedraft/demo_models"
EOS = 0
CHOICE = ("choice", json.dumps([" 0", " 1", " None", " True", " []", " self.x"]), False)


@pytest.fixture(scope="module")
def demo() -> tuple[Any, Any, Any]:
    target = AutoModelForCausalLM.from_pretrained(f"{DEMO}/target", dtype=torch.float32)
    draft = AutoModelForCausalLM.from_pretrained(f"{DEMO}/draft", dtype=torch.float32)
    return target, draft, load_tokenizer(f"{DEMO}/target")


def test_masks_follow_the_drafts_and_leave_the_matcher_where_it_was(demo: tuple[Any, Any, Any]) -> None:
    _, _, tokenizer = demo
    grammars = Grammars(tokenizer, len(tokenizer), [EOS])
    grammars.admit([7, 8], [("regex", "ab+c", False), None], [[], []])
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in "abc")
    masks = grammars.masks([7, 8], np.array([[a, b, a], [a, b, a]]))  # the third draft is refused
    grammars.advance([7, 8], [[a], [a]])  # (the step emitted `a` alone)
    ok = allowed(masks, len(tokenizer))
    assert ok[0, 0, a] and not ok[0, 0, b] and ok[0, 1, b] and not ok[0, 1, c]
    assert ok[0, 2, b] and ok[0, 2, c] and not ok[0, 2, a] and not ok[0, 2, EOS]
    assert ok[0, 3].all() and ok[1].all()  # after a refused draft, and an unconstrained row: nothing masked
    after = allowed(grammars.first_masks([7]), len(tokenizer))[0]  # the matcher moved by `a` only
    assert after[b] and not after[a] and not after[c]
    grammars.admit([9], [("regex", "ab+c", False)], [[a, b]])  # prefilled again after a preemption: past its output
    again = allowed(grammars.first_masks([9]), len(tokenizer))[0]
    assert again[b] and again[c] and not again[a]


def test_a_model_wider_than_its_tokenizer_refuses_the_ids_past_it(demo: tuple[Any, Any, Any]) -> None:
    _, _, tokenizer = demo
    size = len(tokenizer)
    exact = Grammars(tokenizer, size, [EOS])
    wide = Grammars(tokenizer, size + 100, [EOS])  # (not a whole word past it: the last word's bits are split)
    assert wide.grammar_vocab == size and wide.words == exact.words + 4
    a, b = (tokenizer.convert_tokens_to_ids(t) for t in "ab")
    for grammars in (exact, wide):
        grammars.admit([1, 2], [("regex", "ab+c", False), None], [[], []])
    drafts = np.array([[a, size + 7, b], [a, b, a]])  # a draft past the tokenizer's ids: refused
    narrow, masks = exact.masks([1, 2], drafts), wide.masks([1, 2], drafts)
    ok = allowed(masks, size + 100)
    assert torch.equal(ok[..., :size], allowed(narrow, size))
    assert not ok[0, :2, size:].any() and ok[0, 2:].all()  # refused past the tokenizer; free after the refused draft
    assert ok[1].all()  # unconstrained
    assert torch.equal(allowed(wide.draft_masks([1, 2], None), size + 100), ok[:, 0])
    wide.rollback_drafts()


def _language(target: Any, grammars: Grammars, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """Every output the grammar allows and its probability under the masked target (temperature 1), by walking
    the matcher's states with the target's forward at each."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(grammars.compile(CHOICE))
    bitmask = xgrammar.allocate_token_bitmask(1, grammars.vocab_size)
    language: dict[tuple[int, ...], float] = {}

    def walk(prefix: list[int], probability: float) -> None:
        matcher.fill_next_token_bitmask(bitmask)
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + prefix])).logits[0, -1].float()
        p = torch.softmax(logits.masked_fill(~allowed(bitmask[0], logits.shape[0]), float("-inf")), -1)
        for token in p.nonzero()[:, 0].tolist():
            if token == EOS:
                language[(*prefix, token)] = probability * float(p[token])
                continue
            assert matcher.accept_token(token)
            walk([*prefix, token], probability * float(p[token]))
            matcher.rollback(1)

    walk([], 1.0)
    return language


def test_sampled_output_keeps_the_masked_target_distribution(demo: tuple[Any, Any, Any]) -> None:
    """Speculative sampling (k = 3, sampled drafts masked by the grammar too) of a choice: its outputs' frequencies
    against their exact probabilities under the masked target (chi-square). (Drafts the grammar refuses, from a
    draft without a tokenizer: `test_one_masked_decision_keeps_the_masked_distribution`.)"""
    target, draft, tokenizer = demo
    prompt = tokenizer.encode("    x =")
    verifier = Verifier(ModelRunner(target, 64, 32), [EOS], tokenizer=tokenizer)
    proposer = Proposer(ModelRunner(draft, 64, 32), eos_token_ids=[EOS], tokenizer=tokenizer)
    expected = _language(target, verifier.grammars, prompt)
    assert abs(sum(expected.values()) - 1) < 1e-4 and len(expected) >= 20  # (several tokenizations of each)
    samples = 400
    configs = [SamplingConfig(temperature=1.0, seed=i, max_tokens=8, grammar=CHOICE) for i in range(samples)]
    results = generate_offline(verifier, proposer, [OfflineRequest(prompt, c) for c in configs], 3, 64)
    assert all(r.finish == FINISHED_STOP for r in results)
    accepted = sum(r.accepted for r in results)
    assert accepted > samples, accepted  # masked drafts are accepted (unmasked ones, rarely)
    counts = collections.Counter(tuple(r.tokens) for r in results)
    assert set(counts) <= set(expected), set(counts) - set(expected)
    outputs = sorted(expected, key=expected.__getitem__, reverse=True)
    frequent = [o for o in outputs if expected[o] * samples >= 5]  # the rest pooled in one bin
    observed = [counts[o] for o in frequent] + [samples - sum(counts[o] for o in frequent)]
    wanted = [expected[o] * samples for o in frequent]
    wanted.append(samples - sum(wanted))
    assert chisquare(observed, wanted).pvalue > 1e-3, (observed, wanted)


def test_one_masked_decision_keeps_the_masked_distribution() -> None:
    """20,000 rows of one sampled decision (k = 1) against a target whose tokens 5..7 the grammar refuses, drafts
    drawn from a q with mass on allowed and refused tokens alike: the emitted token's frequencies fit the masked
    target's softmax (the accepted draft, and the residual's max(p - q, 0) of a masked p)."""
    rows, vocab = 20_000, 8
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(vocab, generator=gen) * 1.5).expand(rows, 2, vocab).clone()
    bitmask = torch.full((rows, 2, 1), 0b11111, dtype=torch.int32)  # tokens 0..4 allowed
    q = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)
    draft_ids = torch.multinomial(q, rows, replacement=True, generator=gen)[:, None]
    params = RowParams(
        temperature=torch.ones(rows),
        top_k=torch.zeros(rows, dtype=torch.long),
        top_p=torch.ones(rows),
        seed_key=seed_key(torch.arange(rows)),
    )
    masked = masked_logits(logits, bitmask)
    out = rejection_sample(
        masked,
        draft_ids,
        q.expand(rows, 1, vocab),
        params,
        torch.zeros(rows, dtype=torch.long),
        None,
        all_greedy=False,
        filtered=False,
    )
    first = out.tokens[:, 0]
    assert 0 < int(out.num_accepted.sum()) < rows  # both ways of deciding happened
    p = torch.softmax(masked[0, 0], -1)
    counts = torch.bincount(first, minlength=vocab)
    assert int(counts[5:].sum()) == 0
    assert chisquare(counts[:5].numpy(), (p[:5] * rows).numpy()).pvalue > 1e-3, (counts, p * rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["sd", "ar"])
def test_greedy_with_a_grammar_on_cuda_graphs_equals_eager(demo: tuple[Any, Any, Any], mode: str) -> None:
    """On a GPU: with CUDA graphs (the verify's masks a graph input; the draft's proposal eager, masked between
    its forwards) greedy output under a grammar equals the eager steps', and each answer is the grammar's."""
    tokenizer = demo[2]

    def on_cuda(name: str) -> Any:
        model: Any = AutoModelForCausalLM.from_pretrained(f"{DEMO}/{name}", dtype=torch.float32)
        return model.to("cuda")

    target, draft = on_cuda("target"), on_cuda("draft")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    regex = r"def [a-z_]{1,10}\((self)?\):"
    specs = [("json_schema", json.dumps(schema), True), ("regex", regex, False), CHOICE]
    prompt = tokenizer.encode("import os\n# config\nx = ")
    configs = [SamplingConfig(max_tokens=48, grammar=spec) for spec in specs]

    def run(graphs: bool) -> list[list[int]]:
        verifier = Verifier(ModelRunner(target, 4, 256, cuda_graphs=graphs), [EOS], tokenizer=tokenizer)
        runner = ModelRunner(draft, 4, 256, cuda_graphs=graphs)
        proposer = Proposer(runner, eos_token_ids=[EOS], tokenizer=tokenizer) if mode == "sd" else None
        return [
            r.tokens for r in generate_offline(verifier, proposer, [OfflineRequest(prompt, c) for c in configs], 4, 4)
        ]

    graphed = run(True)
    assert graphed == run(False)
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in graphed]
    assert isinstance(json.loads(texts[0])["ok"], bool) and re.fullmatch(regex, texts[1])
    assert texts[2] in json.loads(CHOICE[1]) and all(tokens[-1] == EOS for tokens in graphed)
