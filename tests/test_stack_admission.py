"""A burst of requests is admitted within `--max-prefill-tokens`: the coordinator's step trace shows each prefill."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from stack import TinyPairs, Workers, generate, running_coordinator, text_prompts

from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

BATCH = 4
OUTPUT_LEN = 6


def _prefill_sizes(
    llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path, path: Path, max_prefill_tokens: int
) -> list[int]:
    """Eight requests of 10-20 prompt tokens sent at once to a psd coordinator; the sizes of its prefills."""
    prompts = text_prompts(tiny_pairs.tokenizer, 2 * BATCH, 10, 20, seed=5)
    params = generation_pb2.SamplingParams(max_tokens=OUTPUT_LEN, ignore_eos=True)
    with running_coordinator(
        llama_workers,
        stack_logs,
        "psd",
        max_batch_size=BATCH,
        step_trace=path,
        extra=["--max-prefill-tokens", str(max_prefill_tokens)],
    ) as coordinator:

        async def burst() -> None:
            done = await asyncio.gather(
                *(
                    generate(coordinator.address, generation_pb2.GenerateRequest(prompt_token_ids=p, params=params))
                    for p in prompts
                )
            )
            assert [len(c.token_ids) for c in done] == [OUTPUT_LEN] * len(prompts)

        asyncio.run(burst())
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [e["batch_size"] for e in events if e["kind"] == "prefill"]


def test_a_burst_is_prefilled_a_prompt_at_a_time_below_two_prompts_of_tokens(
    llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path, tmp_path: Path
) -> None:
    """Every prompt has at least 10 tokens, so a limit of 10 lets each step prefill one (a first prompt always goes
    in, however long), whenever the requests arrive."""
    sizes = _prefill_sizes(llama_workers, tiny_pairs, stack_logs, tmp_path / "steps.jsonl", 10)
    assert sizes == [1] * 2 * BATCH, sizes


@pytest.mark.parametrize("limit", [0, 10_000])
def test_without_a_tight_limit_prefills_take_what_waits(
    limit: int, llama_workers: Workers, tiny_pairs: TinyPairs, stack_logs: Path, tmp_path: Path
) -> None:
    sizes = _prefill_sizes(llama_workers, tiny_pairs, stack_logs, tmp_path / "steps.jsonl", limit)
    assert sum(sizes) == 2 * BATCH and max(sizes) > 1, sizes
