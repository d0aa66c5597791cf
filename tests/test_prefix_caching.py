"""Prefix caching inside one prefill: a cold burst sharing a prompt prefix computes it once, losslessly."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from minedraft.engine.sequence_table import prefix_followers
from target_service.verifier import Verifier

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 128
BLOCK = 8
MAX_LEN = 256
ATOL = 1e-5


def _runner(model: PreTrainedModel, slots: int, caching: bool = True) -> ModelRunner:
    return ModelRunner(model, slots, MAX_LEN, block_size=BLOCK, kv_cache_memory=0.01, prefix_caching=caching)


def _assert_fresh(model: PreTrainedModel, runner: ModelRunner, row: int, tokens: list[int], what: str) -> None:
    """Row `row` of `runner` holds the K/V a prefill of `tokens` into an empty cache makes."""
    fresh = _runner(model, 1, caching=False)
    rows = torch.tensor(fresh.allocate(1))
    fresh.forward(rows, torch.tensor([tokens]), torch.tensor([len(tokens)]))
    got, want = runner.cache.rows_state(row), fresh.cache.rows_state(int(rows[0]))
    for layer, ((k, v), (k_ref, v_ref)) in enumerate(zip(got, want, strict=True)):
        assert k.shape == k_ref.shape, f"{what}, layer {layer}: keys {tuple(k.shape)} != {tuple(k_ref.shape)}"
        error = max(float((k - k_ref).abs().max()), float((v - v_ref).abs().max()))
        assert error <= ATOL, f"{what}, layer {layer}: K/V differ from a fresh prefill by {error:.2e}"


def test_one_prompt_of_each_family_goes_first_and_only_where_it_pays() -> None:
    """Keys chain, so prompts with the same first uncached key share everything up to where they part. A, B share
    blocks p, q; C, D share p, r; E and F have nothing in common with anyone."""
    p, q, r, x = b"p", b"q", b"r", b"x"
    keys = [[p, q, b"a"], [p, q, b"b"], [p, r, b"c"], [p, r, b"d"], [x], []]
    # A leads the family of p (it shares 3 blocks with the others, as B, C and D do: the first of equals); B, C, D
    # would save 2, 1 and 1 blocks of 100 tokens.
    assert prefix_followers(keys, [0] * 6, 100, 399) == {1, 2, 3}
    assert prefix_followers(keys, [0] * 6, 100, 400) == set()  # an extra forward costs what it saves
    # The next round, p and q cached by A: B has nothing left to share; C leads the family of r.
    assert prefix_followers([keys[1], keys[2], keys[3]], [2, 1, 1], 100, 0) == {2}
    # A prompt sharing the most blocks with the others leads, whatever its place.
    assert prefix_followers([[p, b"a"], [p, q, b"b"], [p, q, b"c"]], [0, 0, 0], 1, 0) == {0, 2}
    assert prefix_followers([[p, q], [p, q]], [2, 0], 1, 0) == set()  # the first's blocks are all cached already


@pytest.mark.parametrize("earlier", [0, 40])
def test_a_cold_burst_computes_its_common_prefix_once_and_decodes_the_same(
    earlier: int, tiny_models, hf_reference
) -> None:
    """Ten prompts sharing 200 tokens (two of them the same prompt, as samples of one request are), prefilled in one
    call after an earlier prompt left the first `earlier` cached: one of them computes the shared blocks past those,
    the nine others share them and compute only their own rest. Each row's K/V equals a fresh prefill on both
    workers, each row's first token comes from its own prompt: output is the same with and without prefix caching,
    seeded samples as greedy rows, and greedy rows' equal the model's own generate()."""
    target, draft = tiny_models.target("llama", vocab=VOCAB), tiny_models.draft("llama", vocab=VOCAB)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(1, VOCAB, (200,), generator=gen).tolist()
    # Rests of 3-8 tokens: none but the last token's block is full, so the two copies of the first prompt share
    # with it exactly the 25 shared blocks.
    lengths = torch.randint(3, BLOCK + 1, (8,), generator=gen)
    suffixes = [torch.randint(1, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]
    prompts = [shared + s for s in suffixes] + [shared + suffixes[0]] * 2
    seq_ids = list(range(10, 20))
    greedy, sampled = SamplingConfig(max_tokens=16), SamplingConfig(max_tokens=16, temperature=1.0, seed=3)
    configs = [greedy, sampled] * 5  # sampled rows: seeded, so a row's draws depend on its seed and positions only
    outputs = {}
    for caching in (True, False):
        verifier, proposer = Verifier(_runner(target, 12, caching), []), Proposer(_runner(draft, 12, caching))
        for worker in (verifier, proposer):
            if earlier:
                worker.prefill([1], [shared[: earlier + 1] + [7]], configs[:1])  # caches its full shared blocks
                worker.release([1])
        first = verifier.prefill(seq_ids, prompts, configs)
        draft_cached = proposer.prefill(seq_ids, prompts, configs)
        expected = [earlier] + [200] * 9 if caching else [0] * 10  # the 25 full shared blocks; the last token never
        assert first.cached_tokens == expected and draft_cached == expected
        for pool in (verifier.runner.cache.pool, proposer.runner.cache.pool):
            assert pool is not None
            if caching:  # prompt tokens computed: the earlier prompt's, the shared ones past it once, the rests
                rests = sum(len(s) for s in suffixes) + 2 * len(suffixes[0])
                before = earlier + 2 if earlier else 0
                assert pool.stats.queried_tokens == before + sum(len(p) for p in prompts)  # each prompt looked up once
                assert pool.stats.queried_tokens - pool.stats.hit_tokens == before + 200 - earlier + rests
        tokens = [t for t, _, _ in first.per_row()]
        for s, prompt in zip(seq_ids, prompts, strict=True):
            row = verifier.table.rows_by_id[s]
            _assert_fresh(target, verifier.runner, row, prompt, f"target seq {s}")
            _assert_fresh(draft, proposer.runner, proposer.table.rows_by_id[s], prompt, f"draft seq {s}")
        for _ in range(4):
            steps = verifier.verify(seq_ids, torch.zeros(len(seq_ids), 0, dtype=torch.long), None).per_row()
            for b, (emitted, _, _) in enumerate(steps):
                tokens[b] += emitted
        outputs[caching] = tokens
    assert outputs[True] == outputs[False]
    assert outputs[True][::2] == [hf_reference(target, prompt, 5) for prompt in prompts[::2]]
