"""TETRIS through the services: greedy output equals HF `generate()` with extra proposals and per-row lengths."""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from reference import hf_greedy
from stack import (
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate,
    in_process_coordinator,
    run_async,
    start_workers,
    text_prompts,
)

from minedraft.observability.metrics import CoordinatorMetrics
from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

K, EXTRA = 3, 2
# KV cache of the small stack: 64 blocks of 4 tokens for the tiny Llama target (512 bytes a token), so a verify's
# k + E + 1 = 6 positions cross block boundaries, and 8 sequences of ~70 tokens need more than the pool holds.
SMALL_BLOCKS_GIB = 64 * 4 * 512 / 2**30


@pytest.fixture(scope="module")
def small_blocks(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    extra = ["--block-size", "4", "--kv-cache-memory", str(SMALL_BLOCKS_GIB)]
    workers = start_workers(tiny_pairs["llama"], stack_logs, extra=extra)
    try:
        yield workers
    finally:
        workers.stop()


def _greedy_requests(
    pairs: TinyPairs,
    count: int,
    lengths: tuple[int, int],
    budgets: tuple[int, int],
    seed: int,
    penalty: float | None = None,
) -> tuple[list[generation_pb2.GenerateRequest], list[list[int]]]:
    """Greedy requests (half of them prompts that repeat their text, which the draft predicts better; with a
    repetition `penalty`, and log-probabilities asked for) and each one's HF `generate()` tokens."""
    from transformers import AutoModelForCausalLM

    pair = pairs["llama"]
    rng = random.Random(seed)
    prompts = text_prompts(pairs.tokenizer, count, *lengths, seed=seed)
    prompts = [p + p[: len(p) // 2] if i % 2 else p for i, p in enumerate(prompts)]
    model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    requests, expected = [], []
    for prompt in prompts:
        budget = rng.randint(*budgets)
        expected.append(
            hf_greedy(model, prompt, budget, **({} if penalty is None else {"repetition_penalty": penalty}))
        )
        params = generation_pb2.SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        if penalty is not None:
            params.repetition_penalty, params.logprobs = penalty, 2
        requests.append(generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params))
    return requests, expected


def _sample(metrics: CoordinatorMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _rows_verifying_at_most(metrics: CoordinatorMetrics, drafts: float) -> float:
    """Rows of the verifies so far that verified at most `drafts` drafts (the histogram's bucket)."""
    bound = "+Inf" if drafts == float("inf") else str(drafts)
    return _sample(metrics, "minedraft_tetris_verified_drafts_bucket", le=bound)


def _serve(workers: Workers, requests: list[generation_pb2.GenerateRequest], mode: str, **options: object) -> tuple:
    metrics = CoordinatorMetrics()

    async def run() -> tuple[list[list[int]], int]:
        settings = dict(mode=mode, num_speculative_tokens=K, speculation="always", tetris=True)
        async with in_process_coordinator(workers, metrics=metrics, **{**settings, **options}) as (address, coord):
            done = await asyncio.gather(*(generate(address, r) for r in requests))
            return [d.token_ids for d in done], coord.loop.admission.preemptions

    outputs, preemptions = run_async(run())
    return outputs, preemptions, metrics


@pytest.mark.parametrize(("mode", "budget"), [("psd", 2), ("sd", 20)])
def test_tetris_greedy_equals_generate_with_rows_of_every_length(
    mode: str, budget: int, llama_workers: Workers, tiny_pairs: TinyPairs
) -> None:
    """k + E drafts a row; a budget of 2 over batches of up to 4 leaves rows of 0, 1 and 2 drafts in one verify,
    one of 20 verifies all k + E of each row; every greedy output is `generate()`'s, with a repetition penalty and
    log-probabilities too, beside a sampled request. (The tiny draft is near uniform, so
    the default budget, k a row, keeps k of each.)"""
    requests, expected = _greedy_requests(tiny_pairs, 8, (6, 30), (8, 24), seed=5)
    penalized, expected_penalized = _greedy_requests(tiny_pairs, 2, (6, 30), (8, 24), seed=6, penalty=1.3)
    requests, expected = requests + penalized, expected + expected_penalized
    sampled = generation_pb2.SamplingParams(max_tokens=12, temperature=0.9, top_k=50, ignore_eos=True)
    requests.append(generation_pb2.GenerateRequest(prompt_token_ids=requests[0].prompt_token_ids, params=sampled))
    outputs, _, metrics = _serve(
        llama_workers, requests, mode, tetris_extra_proposals=str(EXTRA), verify_token_budget=budget
    )
    assert outputs[:-1] == expected
    assert len(outputs[-1]) == 12  # (sampled with the draft's q over selected prefixes: its distribution is the
    # sampler's chi-square test's, tests/test_tetris.py)
    at_most = functools.partial(_rows_verifying_at_most, metrics)
    if budget < K:
        assert 0 < at_most(0.0) < at_most(1.0), "no rows of 0 and of 1 drafts in a verify: the test proves nothing"
    else:
        assert at_most(float(K)) < at_most(float("inf")), "no row verified more than k drafts"
    assert _sample(metrics, "minedraft_tetris_extra_drafts_total") > 0
    # Drafts count as verified, not as proposed: the acceptance rate is of what the target checked.
    assert _sample(metrics, "minedraft_draft_tokens_total") == _sample(metrics, "minedraft_tetris_verified_drafts_sum")
    assert_all_slots_free(llama_workers)


def test_tetris_across_block_boundaries_and_preemption(small_blocks: Workers, tiny_pairs: TinyPairs) -> None:
    """Blocks of 4 tokens, a pool too small for the load (preemption), the default budget (k a row) and auto
    extra proposals: every output is `generate()`'s, and the budget is spent in full on full batches."""
    requests, expected = _greedy_requests(tiny_pairs, 8, (50, 80), (30, 40), seed=3)
    outputs, preemptions, metrics = _serve(small_blocks, requests, "psd", tetris_extra_proposals="auto")
    assert outputs == expected
    assert preemptions > 0, "the load never ran short of blocks: the test proves nothing"
    assert _sample(metrics, "minedraft_tetris_budget_use_count") > 0
    assert _sample(metrics, "minedraft_tetris_budget_use_bucket", le="0.9") < _sample(
        metrics, "minedraft_tetris_budget_use_count"
    ), "no verify spent its whole budget"
    assert_all_slots_free(small_blocks, timeout=15)
