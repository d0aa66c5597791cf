"""TETRIS's ragged verify (only each row's selected drafts run) equals the padded verify: tokens, logprobs, K/V."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from minedraft.engine.cuda_graphs import ragged_tokens
from minedraft.engine.forward_pass import StepShape, ragged_layout
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from target_service.selected_verify import verify_variants
from target_service.verifier import Verifier

pytestmark = pytest.mark.usefixtures("single_thread")

K = 8  # drafts a row (k + E = 4 + 4)
ROWS = 5
CACHE_LEN = 96
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3], [40, 41, 42, 43]]


def _greedy_drafts(draft: PreTrainedModel, histories: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """Each row's `K` greedy drafts from `draft` (the target with noise: about half accepted), -1 past its length."""
    ids = torch.full((len(histories), K), -1, dtype=torch.long)
    with torch.inference_mode():
        for b, history in enumerate(histories):
            context = torch.tensor([history])
            for j in range(lengths[b]):
                token = draft(context).logits[0, -1].argmax()
                ids[b, j] = token
                context = torch.cat([context, token.view(1, 1)], dim=1)
    return ids


def _verifiers(target: PreTrainedModel) -> tuple[Verifier, Verifier, Verifier]:
    """(padded, ragged, ragged and cut to 4 drafts where they fit) verifiers of `target`, each on a runner and cache
    of its own."""
    padded, ragged, cut = (Verifier(ModelRunner(target, ROWS, CACHE_LEN), []) for _ in range(3))
    padded.ragged_verifies = False
    cut.verify_widths = (K // 2, K)
    return padded, ragged, cut


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
@pytest.mark.parametrize("kind", ["greedy", "greedy-logprobs", "sampled-logprobs"])
def test_ragged_verify_equals_padded(arch: str, kind: str, tiny_models) -> None:
    """Same rows, same selected drafts (rows of 0..K, one of none and one of all; every other step at most K / 2): the
    ragged verify emits the very tokens the padded one does, with the same logprobs, and leaves the same K/V in every
    row; so does one cut to K / 2 drafts where they fit. (Plain greedy takes the argmax over the flattened tokens'
    logits, `flat_argmax`.)"""
    sampled, logprobs = kind.startswith("sampled"), 3 if kind.endswith("logprobs") else None
    target = tiny_models.target(arch, **({"sliding_window": 6} if arch == "mistral" else {}))
    draft = tiny_models.noisy_draft(arch, **({"sliding_window": 6} if arch == "mistral" else {}))
    verifiers = _verifiers(target)
    configs = [
        SamplingConfig(max_tokens=60, logprobs=logprobs, temperature=0.8 if sampled else 0.0, seed=11 + b)
        for b in range(ROWS)
    ]
    seq_ids = list(range(ROWS))
    first = [v.prefill(seq_ids, PROMPTS, configs).per_row() for v in verifiers]
    assert first[0] == first[1]
    histories = [p + tokens for p, (tokens, _, _) in zip(PROMPTS, first[0], strict=True)]
    gen = torch.Generator().manual_seed(3)
    accepted = 0
    for step in range(6):
        longest = K if step % 2 == 0 else K // 2
        lengths = torch.randint(0, longest + 1, (ROWS,), generator=gen).tolist()
        lengths[step % ROWS], lengths[(step + 1) % ROWS] = 0, longest
        drafts = _greedy_drafts(draft, histories, lengths)
        probs = torch.rand(ROWS, K, target.config.vocab_size, generator=gen).softmax(-1) if sampled else None
        results = [v.verify(seq_ids, drafts.clone(), probs, selected=True) for v in verifiers]
        rows = [r.per_row() for r in results]
        assert rows[0] == rows[1] == rows[2], f"step {step}, lengths {lengths}"
        assert results[0].verified == results[1].verified == results[2].verified == lengths
        for padded, *others in zip(*(r.logprobs_per_row() for r in results), strict=True):
            for ragged in others:
                assert (padded is None) == (ragged is None) == (logprobs is None)
                if padded is None or ragged is None:
                    continue
                for (p_chosen, p_top), (r_chosen, r_top) in zip(padded, ragged, strict=True):
                    assert r_chosen == pytest.approx(p_chosen, abs=1e-4)
                    assert [i for i, _ in r_top] == [i for i, _ in p_top]
                    assert [v for _, v in r_top] == pytest.approx([v for _, v in p_top], abs=1e-4)
        accepted += sum(a for _, a, _ in rows[0])
        for history, (tokens, _, _) in zip(histories, rows[0], strict=True):
            history += tokens
    assert accepted > 0  # drafts were accepted, not only rejected
    # k + E + 1 = 9 tokens a row still run as CUDA graphs (the keys a GPU would capture; eager past MAX_GRAPH_TOKENS)
    assert all(any("selected" in str(key[0]) for key in v.runner.step_keys) for v in verifiers)
    shapes = [{key[4] for key in v.runner.step_keys if "selected" in str(key[0])} for v in verifiers]  # (drafts)
    wide, cut = ((K,), torch.long), ((K // 2,), torch.long)
    assert shapes[0] == shapes[1] == {wide} and shapes[2] == {wide, cut}
    for row in range(ROWS):
        states = [v.runner.cache.rows_state(row) for v in verifiers]
        for (pk, pv), *others in zip(*states, strict=True):
            for rk, rv in others:
                torch.testing.assert_close(rk, pk, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(rv, pv, rtol=1e-5, atol=1e-5)


def test_selected_drafts_of_one_length_in_every_row_verify_as_plain_sd(tiny_models) -> None:
    """A selection that kept K / 2 drafts in every row (the budget spread evenly: acceptance alike in every row) is
    cut to K / 2 and runs plain SD's verify, no layout or lengths: the tokens and counts of the plain verify of those
    drafts, under the plain verify's step key."""
    target, draft = tiny_models.target("llama"), tiny_models.noisy_draft("llama")
    selecting, plain = (Verifier(ModelRunner(target, ROWS, CACHE_LEN), []) for _ in range(2))
    selecting.verify_widths = (K // 2, K)
    configs = [SamplingConfig(max_tokens=60) for _ in range(ROWS)]
    seq_ids = list(range(ROWS))
    first = [v.prefill(seq_ids, PROMPTS, configs).per_row() for v in (selecting, plain)]
    histories = [p + tokens for p, (tokens, _, _) in zip(PROMPTS, first[0], strict=True)]
    drafts = _greedy_drafts(draft, histories, [K // 2] * ROWS)
    result = selecting.verify(seq_ids, drafts.clone(), None, selected=True)
    expected = plain.verify(seq_ids, drafts[:, : K // 2].clone(), None)
    assert result.per_row() == expected.per_row()
    assert result.verified == [K // 2] * ROWS
    assert not any("selected" in str(key[0]) for key in selecting.runner.step_keys)
    assert selecting.runner.step_keys == plain.runner.step_keys


def test_ragged_forward_logits_equal_padded(tiny_models) -> None:
    """The forward itself: at every valid position the ragged logits equal the padded ones (float32), past a row's
    valid tokens they repeat its last one's, with padding tokens beyond the valid total."""
    target = tiny_models.target("llama")
    runners = [ModelRunner(target, ROWS, CACHE_LEN) for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([3, 0, 7, 1, 5])
    rows = torch.arange(ROWS)
    ids = torch.randint(0, 128, (ROWS, 7), generator=gen)
    for runner in runners:  # a prefix of a different length in each row
        runner.cache.reserve(list(range(ROWS)), [30] * ROWS)
        prefix = torch.randint(0, 128, (ROWS, 12), generator=gen.manual_seed(6))
        runner.forward(rows, prefix, torch.tensor([12, 4, 9, 1, 6]))
    shape = StepShape(padded=ROWS, kv_len=64)
    with torch.inference_mode():
        padded = runners[0].step_forward(rows, ids, counts, shape=shape, last_only=False)
        ragged = runners[1].step_forward(rows, ids, counts, shape=shape, last_only=False, flattened=20)
    assert ragged.shape == padded.shape
    for b, count in enumerate(counts.tolist()):
        torch.testing.assert_close(ragged[b, :count], padded[b, :count], rtol=1e-5, atol=1e-5)
        if count:
            assert torch.equal(ragged[b, count:], ragged[b, count - 1].expand(7 - count, -1))
    assert torch.equal(runners[0].cache.lengths, runners[1].cache.lengths)


def test_ragged_layout_skips_empty_rows_and_pads_to_the_total() -> None:
    """Rows of 2, 0 and 3 tokens at lengths 5, 9 and 0, flattened to 7 tokens: the 5 valid ones row after row,
    two padding ones on the fill row."""
    layout = ragged_layout(
        rows=torch.tensor([4, 1, 2]),
        starts=torch.tensor([5, 9, 0]),
        counts=torch.tensor([2, 0, 3]),
        width=4,
        total=7,
        fill_row=8,
    )
    assert layout.rows.tolist() == [4, 4, 2, 2, 2, 8, 8]
    assert layout.positions[:, 0].tolist() == [5, 6, 0, 1, 2, 0, 0]
    assert layout.sources.tolist() == [0, 1, 8, 9, 10, 0, 0]
    assert layout.slots.tolist() == [0, 1, 8, 9, 10, 12, 12]
    assert layout.unflatten.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [2, 3, 4, 4]]


def test_ragged_graph_buckets_are_batch_multiples_on_cuda_only() -> None:
    """On CUDA a ragged verify's tokens round up to a multiple of the padded batch (graphs keyed by 1..k + 1
    tokens a row), and precapture runs each; elsewhere the exact total, and only the widest is run ahead."""
    assert ragged_tokens(16, 80, cuda=True) == 80 and ragged_tokens(16, 81, cuda=True) == 96
    assert ragged_tokens(3, 5, cuda=True) == 8  # (3 rows pad to 4)
    assert ragged_tokens(16, 81, cuda=False) == 81
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert verify_variants(4, True, True, cuda) == [(False, 0), *((True, w) for w in range(1, 6))]
    assert verify_variants(4, True, True, cpu) == [(False, 0), (True, 5)]
    assert verify_variants(4, True, False, cpu) == [(False, 0), (True, 0)]
    assert verify_variants(0, True, True, cuda) == verify_variants(4, False, True, cuda) == [(False, 0)]


def test_compiled_layers_compile_ragged_steps_ahead_and_equal_uncompiled(tiny_models) -> None:
    """With compiled layers, `warm_up_ragged` (what a Prepare for TETRIS runs, `Verifier.warm_up`) compiles the
    ragged forward: afterwards ragged steps of 1 and several rows, totals from 1 token up, compile nothing (it would
    fail here) and give the uncompiled forward's logits. (The layers only: the acceptance's compiles, already
    tested by tests/test_compile.py, took minutes more.)"""
    # Two copies of the target: compiling changes a model in place, and the eager runner must not run compiled layers.
    compiled = ModelRunner(tiny_models.target("llama"), ROWS, CACHE_LEN, compile_layers=True)
    eager = ModelRunner(tiny_models.target("llama"), ROWS, CACHE_LEN)
    compiled.forward_pass.warm_up_ragged(compiled.scratch_row, K + 1, compiled.step_shape(1, K + 1, K + 1)[1])
    gen = torch.Generator().manual_seed(9)
    for rows, counts in (([0], [1]), ([1], [K + 1]), ([2, 3, 4], [1, 0, K + 1]), ([2, 3, 4], [3, K + 1, 2])):
        ids = torch.randint(0, 128, (len(rows), K + 1), generator=gen)
        logits = []
        prefix = torch.randint(0, 128, (len(rows), 4), generator=gen)
        for runner in (compiled, eager):
            runner.cache.reserve(rows, [CACHE_LEN] * len(rows))
            runner.cache.lengths[rows] = 0
            runner.forward_pass.unseen_step_stance = "eager_on_recompile"  # (the prefix: any kind, as it comes)
            runner.forward(torch.tensor(rows), prefix, torch.full((len(rows),), 4))
            runner.forward_pass.unseen_step_stance = "fail_on_recompile"
            shape = StepShape(padded=len(rows), kv_len=runner.step_shape(1, K + 5, K + 1)[1])
            with torch.inference_mode():
                logits.append(
                    runner.step_forward(
                        torch.tensor(rows),
                        ids,
                        torch.tensor(counts),
                        shape=shape,
                        last_only=False,
                        flattened=sum(counts),
                    )
                )
        for b, count in enumerate(counts):
            torch.testing.assert_close(logits[0][b, :count], logits[1][b, :count], rtol=1e-4, atol=1e-4, msg=str(rows))
