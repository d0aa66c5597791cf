"""N-gram drafting through the services: greedy output equals HF `generate()` of the target in psd, sd and ar."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    spawn,
    text_prompts,
    wait_all,
    worker_args,
    worker_info,
)

from minedraft.engine.models import load_tokenizer
from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

WORKER_BATCH = 4
NUM_REQUESTS = 12
K = 4


@pytest.fixture(scope="module")
def ngram_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    """The Llama target, and a draft service that drafts by n-gram lookup, given the target's directory only."""
    pair = tiny_pairs["llama"]
    target = spawn("ngram-target", worker_args("target", pair.target, WORKER_BATCH), stack_logs)
    draft_args = worker_args("draft", pair.target, WORKER_BATCH) + ["--speculative-method", "ngram", "--ngram-max", "3"]
    draft = spawn("ngram-draft", draft_args, stack_logs)
    workers = Workers(pair, target, draft, WORKER_BATCH)
    try:
        wait_all([target, draft])
        yield workers
    finally:
        workers.stop()


def _requests(pairs: TinyPairs) -> tuple[list[tuple[generation_pb2.GenerateRequest, float]], list[list[int]]]:
    """Greedy requests (with start delays: they join and leave mid-flight), half of them prompts that repeat their
    own text (what n-gram lookup finds), and each one's HF `generate()` tokens."""
    from transformers import AutoModelForCausalLM

    pair = pairs["llama"]
    rng = random.Random(3)
    prompts = text_prompts(load_tokenizer(str(pair.target)), NUM_REQUESTS, 6, 40, seed=4)
    prompts = [p * 2 if i % 2 else p for i, p in enumerate(prompts)]
    model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)
    requests, expected = [], []
    for prompt in prompts:
        budget = rng.randint(1, 28)
        expected.append(hf_greedy(model, prompt, budget))  # (EOS does not stop it: the requests ignore EOS)
        params = generation_pb2.SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)
        requests.append((request, rng.uniform(0.0, 0.6)))
    return requests, expected


async def _run(address: str, requests: list[tuple[generation_pb2.GenerateRequest, float]]) -> list[Any]:
    async def one(request: generation_pb2.GenerateRequest, delay: float) -> Any:
        await asyncio.sleep(delay)
        return await generate(address, request, timeout=120)

    return list(await asyncio.gather(*(one(r, d) for r, d in requests)))


def test_ngram_greedy_matches_target_alone(ngram_workers: Workers, tiny_pairs: TinyPairs) -> None:
    """The draft loads no model (it reports no KV blocks) yet drafts: in psd and sd, drafts are made and some
    accepted (the repeated prompts), and every mode gives `generate()`'s tokens."""
    assert ngram_workers.draft is not None
    info = worker_info(ngram_workers.draft.address, "draft")
    assert info.block_size == 0 and info.device == "cpu"
    requests, expected = _requests(tiny_pairs)

    async def run(mode: str) -> list[Any]:
        async with in_process_coordinator(ngram_workers, mode=mode, num_speculative_tokens=K) as (address, _):
            return await _run(address, requests)

    for mode in ("psd", "sd", "ar"):
        done = run_async(run(mode))
        assert [c.token_ids for c in done] == expected, mode
        drafted = sum(c.usage.draft_tokens for c in done)
        accepted = sum(c.usage.accepted_tokens for c in done)
        if mode == "ar":
            assert drafted == 0
        else:
            assert drafted > 0 and accepted > 0, (mode, drafted, accepted)
    assert_all_slots_free(ngram_workers)


def test_ngram_with_tetris_keeps_generate_output(ngram_workers: Workers, tiny_pairs: TinyPairs) -> None:
    """TETRIS with a drafter that has no probabilities (every draft scored alike): k + 2 drafts a row, a budget
    of 6 over batches of up to 4, so rows verify different prefixes; psd gives `generate()`'s tokens."""
    requests, expected = _requests(tiny_pairs)

    async def run() -> list[Any]:
        options: dict[str, Any] = dict(
            num_speculative_tokens=K, tetris=True, tetris_extra_proposals="2", verify_token_budget=6
        )
        async with in_process_coordinator(ngram_workers, mode="psd", **options) as (address, _):
            return await _run(address, requests)

    done = run_async(run())
    assert [c.token_ids for c in done] == expected
    assert sum(c.usage.accepted_tokens for c in done) > 0
    assert_all_slots_free(ngram_workers)
