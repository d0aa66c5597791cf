"""`--speculation auto` through the stack: drafts that do not pay leave the target decoding alone, output unchanged;
drafts that pay keep drafting; shorter drafts are tried with `--min-speculative-tokens`, output unchanged; a request
sampled with its client's seed is drafted at every step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from stack import (
    Completion,
    TinyPair,
    TinyPairs,
    Workers,
    generate,
    running_coordinator,
    start_workers,
    text_prompts,
)

from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

K = 4
MAX_TOKENS = 160  # enough steps for a few trials of each way (`measured_choice.PROBE_EVERY`)


@pytest.fixture(scope="module")
def self_draft_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    """The tiny Llama target drafting for itself: nearly every draft is accepted."""
    pair = tiny_pairs["llama"]
    workers = start_workers(TinyPair("llama-self", pair.target, pair.target), stack_logs)
    try:
        yield workers
    finally:
        workers.stop()


def _greedy(prompts: list[list[int]]) -> list[generation_pb2.GenerateRequest]:
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return [generation_pb2.GenerateRequest(prompt_token_ids=p, params=params) for p in prompts]


def _serve(
    workers: Workers, stack_logs: Path, requests: list[generation_pb2.GenerateRequest], extra: tuple[str, ...] = ()
) -> tuple[list[Completion], str]:
    """The completions of `requests`, sent at once to a psd coordinator (--speculation auto), and its log."""

    async def all_of() -> list[Completion]:
        return await asyncio.gather(*(generate(coordinator.address, r) for r in requests))

    with running_coordinator(workers, stack_logs, "psd", k=K, extra=extra) as coordinator:
        done = asyncio.run(all_of())
    return done, coordinator.log_tail(100_000)


def _drafted_share(completion: Completion) -> float:
    """The share of a request's verify steps that verified drafts."""
    usage = completion.usage
    assert usage.draft_tokens == K * usage.drafted_steps
    return usage.drafted_steps / usage.steps


def test_drafts_that_do_not_pay_leave_the_target_decoding_alone(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path, hf_reference
) -> None:
    """The tiny Llama pair's draft is unrelated to its target (it accepts next to nothing), so a drafting step costs
    more per token than the target's step alone: the coordinator decodes alone within a few trials, and its output
    still equals `generate()` (the draft catches up on what it missed whenever a trial drafts again)."""
    from transformers import AutoModelForCausalLM

    prompts = text_prompts(tiny_pairs.tokenizer, 3, 6, 20, seed=21)
    done, log = _serve(llama_workers, stack_logs, _greedy(prompts))
    target = AutoModelForCausalLM.from_pretrained(tiny_pairs["llama"].target, dtype=torch.float32).eval()
    assert [c.token_ids for c in done] == [hf_reference(target, p, MAX_TOKENS) for p in prompts]
    assert "drafts do not pay, decoding with the target alone" in log
    assert all(_drafted_share(c) < 0.5 for c in done), [(c.usage.drafted_steps, c.usage.steps) for c in done]


def test_shorter_drafts_are_tried_and_output_is_unchanged(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path, hf_reference
) -> None:
    """With `--min-speculative-tokens 1` a step may draft 4, 2 or 1 tokens, or none: the unrelated tiny pair's
    drafts are rejected whatever their length, so shorter ones cost less and are taken. Whatever lengths the steps
    drafted, output equals `generate()`."""
    from transformers import AutoModelForCausalLM

    prompts = text_prompts(tiny_pairs.tokenizer, 3, 6, 20, seed=24)
    done, log = _serve(llama_workers, stack_logs, _greedy(prompts), ("--min-speculative-tokens", "1"))
    target = AutoModelForCausalLM.from_pretrained(tiny_pairs["llama"].target, dtype=torch.float32).eval()
    assert [c.token_ids for c in done] == [hf_reference(target, p, MAX_TOKENS) for p in prompts]
    assert all(0 < c.usage.draft_tokens < K * c.usage.drafted_steps for c in done), [
        (c.usage.draft_tokens, c.usage.drafted_steps) for c in done
    ]
    assert "shorter drafts pay" in log or "drafts do not pay" in log


def test_a_request_sampled_with_its_seed_is_drafted_at_every_step(
    tiny_pairs: TinyPairs, llama_workers: Workers, stack_logs: Path
) -> None:
    """Whether a sampled position was drafted changes the token the seed gives it: with such a request running,
    every step drafts, however little the drafts pay, so that the seed gives the same output every time."""
    prompt = text_prompts(tiny_pairs.tokenizer, 1, 6, 20, seed=22)[0]
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=5)
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params)
    (first,), _ = _serve(llama_workers, stack_logs, [request])
    (again,), _ = _serve(llama_workers, stack_logs, [request])
    assert _drafted_share(first) == 1.0
    assert first.token_ids == again.token_ids


def test_drafts_that_pay_keep_drafting(tiny_pairs: TinyPairs, self_draft_workers: Workers, stack_logs: Path) -> None:
    """A draft that is its own target has nearly every draft accepted: the coordinator keeps drafting (trials of
    the target alone aside)."""
    prompts = text_prompts(tiny_pairs.tokenizer, 3, 6, 20, seed=23)
    done, log = _serve(self_draft_workers, stack_logs, _greedy(prompts))
    assert "drafts do not pay" not in log
    assert all(_drafted_share(c) > 0.8 for c in done), [(c.usage.drafted_steps, c.usage.steps) for c in done]
