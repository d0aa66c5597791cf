"""Target and draft services over two gloo ranks each (real processes) serve what one rank serves, and a target
fails fast without one.

Greedy output through the stack equals Hugging Face `generate()` (Llama in psd, sd and ar; Qwen3 in psd and ar;
GPT-NeoX in psd; the draft over two ranks too), and seeded sampled output equals that of one-rank services; a rank
killed or hung mid-load ends every admitted request with UNAVAILABLE within seconds, and the group started again is
taken back."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from grpc_health.v1 import health_pb2
from stack import (
    Service,
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate_all,
    mixed_requests,
    running_coordinator,
    signal_while_streaming,
    spawn,
    stop_all,
    text_prompts,
    wait_all,
    wait_health,
    worker_args,
)

from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

ARCHS = ("llama", "qwen3", "gpt_neox")
BATCH = 4  # 8 requests over batches of 4: they queue, join and leave mid-flight


def _tp_target_args(tiny_pairs: TinyPairs, arch: str) -> list[str]:
    return [*worker_args("target", tiny_pairs[arch].target, BATCH), "--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def tp_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[dict[str, Workers]]:
    """Llama, Qwen3 and GPT-NeoX targets over two ranks each, and one draft over two ranks (the Llama pair's: all
    share its tokenizer), started at once."""
    targets = {arch: spawn(f"{arch}-target-tp2", _tp_target_args(tiny_pairs, arch), stack_logs) for arch in ARCHS}
    draft_args = [*worker_args("draft", tiny_pairs["llama"].draft, BATCH), "--tensor-parallel-size", "2"]
    draft = spawn("llama-draft-tp2", draft_args, stack_logs)
    wait_all([*targets.values(), draft])
    workers = {arch: Workers(tiny_pairs[arch], target, draft, BATCH) for arch, target in targets.items()}
    try:
        yield workers
    finally:
        stop_all([draft, *(w.target for w in workers.values())])  # (a target a test started again included)


@pytest.fixture(scope="module")
def greedy(tiny_pairs: TinyPairs) -> dict[str, tuple[list[generation_pb2.GenerateRequest], list[list[int]]]]:
    """Per architecture: requests, and what `generate()` of the target alone continues them with."""
    from transformers import AutoModelForCausalLM

    prompts = text_prompts(tiny_pairs.tokenizer, 8, 4, 40, seed=42)
    requests = [
        generation_pb2.GenerateRequest(
            prompt_token_ids=prompt, params=generation_pb2.SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True)
        )
        for i, prompt in enumerate(prompts)
    ]
    cases = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(tiny_pairs[arch].target, dtype=torch.float32)
        model.generation_config.eos_token_id = None  # (the requests ignore EOS)
        expected = []
        for request in requests:
            ids = torch.tensor([list(request.prompt_token_ids)])
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=request.params.max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            expected.append(out[0, ids.shape[1] :].tolist())
        cases[arch] = (requests, expected)
    return cases


# Llama's psd is in the last test, on the coordinator that then sees a rank killed; Qwen3's sd runs the very verify
# its psd does (left out: each case costs a coordinator's start). Qwen3's psd crosses the nccl channel (gloo) between
# the target's and the draft's rank 0s, each holding its group's default process group beside the pair's own.
@pytest.mark.parametrize(
    ("arch", "mode", "channel"),
    [
        ("llama", "sd", "grpc"),
        ("llama", "ar", "grpc"),
        ("qwen3", "psd", "nccl"),
        ("qwen3", "ar", "grpc"),
        ("gpt_neox", "psd", "grpc"),
    ],
)
def test_two_ranks_greedy_match_generate(
    arch: str,
    mode: str,
    channel: str,
    tp_workers: dict[str, Workers],
    greedy: dict[str, tuple[list[generation_pb2.GenerateRequest], list[list[int]]]],
    stack_logs: Path,
) -> None:
    requests, expected = greedy[arch]
    extra = ["--channel", channel]
    with running_coordinator(tp_workers[arch], stack_logs, mode, max_batch_size=BATCH, extra=extra) as coordinator:
        got = asyncio.run(generate_all(coordinator.address, requests))
    assert got == expected
    assert_all_slots_free(tp_workers[arch])


def _rank_pid(service: Service) -> int:
    """The pid of rank 1 of a service over two ranks, as its log says."""
    found = re.search(r"rank 1 of 2 started as pid (\d+)", service.log_tail(10**6))
    assert found, service.log_tail()
    return int(found.group(1))


def _lose_rank(
    coordinator: Service, workers: Workers, requests: list[generation_pb2.GenerateRequest], sig: int
) -> None:
    """Rank 1 of the target sent `sig` mid-load: every request ends with UNAVAILABLE within 10 s, the coordinator
    says NOT_SERVING, and rank 0 exits with 1 (for its supervisor to start the group anew)."""
    ended, seconds = asyncio.run(signal_while_streaming(coordinator.address, requests, _rank_pid(workers.target), sig))
    assert all(e.startswith("UNAVAILABLE: ") for e in ended), ended
    assert seconds < 10, seconds
    wait_health(coordinator.address, health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
    assert workers.target.proc.wait(timeout=15) == 1


def test_psd_then_a_killed_rank_then_a_hung_one(
    tp_workers: dict[str, Workers],
    llama_workers: Workers,
    greedy: dict[str, tuple[list[generation_pb2.GenerateRequest], list[list[int]]]],
    tiny_pairs: TinyPairs,
    stack_logs: Path,
) -> None:
    """Llama in psd: greedy output as `generate()`'s, seeded sampled output (the draft's probabilities cross the
    channel to rank 0, which hands them on) as the one-rank target's; then rank 1 killed mid-load ends every request
    with UNAVAILABLE within 10 s; the group started again on its port is taken back and serves as before; then its
    rank 1 stopped (SIGSTOP: it hangs, its sockets open) does the same, well before the collectives' 60 s timeout,
    once the draft's rank 1 stopped has cost the draft alone. Last in this module: both services stop for good."""
    sampled = mixed_requests(tiny_pairs.tokenizer)
    with running_coordinator(llama_workers, stack_logs, "psd", max_batch_size=BATCH) as coordinator:
        one_rank = asyncio.run(generate_all(coordinator.address, sampled))
    workers = tp_workers["llama"]
    params = generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    long = [
        generation_pb2.GenerateRequest(prompt_token_ids=p, params=params)
        for p in text_prompts(tiny_pairs.tokenizer, 6, 4, 20, seed=5)
    ]
    requests, expected = greedy["llama"]
    retry = ["--draft-retry-interval", "0.2"]  # (how often a lost target is tried again)
    with running_coordinator(workers, stack_logs, "psd", max_batch_size=BATCH, extra=retry) as coordinator:
        assert asyncio.run(generate_all(coordinator.address, requests)) == expected
        assert asyncio.run(generate_all(coordinator.address, sampled)) == one_rank  # (the draft's q matter here)
        assert "rank 1 of 2 started as pid" in workers.draft.log_tail(10**6)  # type: ignore[union-attr]
        assert_all_slots_free(workers)
        _lose_rank(coordinator, workers, long, signal.SIGKILL)
        assert "tensor-parallel tp-rank-1 (pid" in workers.target.log_tail(10**6)

        workers.target = spawn(
            "llama-target-tp2-restarted", _tp_target_args(tiny_pairs, "llama"), stack_logs, port=workers.target.port
        )
        wait_all([workers.target])
        wait_health(coordinator.address, health_pb2.HealthCheckResponse.SERVING)
        assert asyncio.run(generate_all(coordinator.address, requests)) == expected

        # The draft's rank 1 stopped: the draft service leaves (its rank 0 exits), the requests finish on the target
        # alone, as generate() would.
        draft = workers.draft
        assert draft is not None
        ended, _ = asyncio.run(signal_while_streaming(coordinator.address, long, _rank_pid(draft), signal.SIGSTOP))
        assert ended == ["FINISH_REASON_LENGTH"] * len(long), ended
        assert draft.proc.wait(timeout=15) == 1
        assert "has not reported for" in draft.log_tail(10**6)
        assert asyncio.run(generate_all(coordinator.address, requests)) == expected

        _lose_rank(coordinator, workers, long, signal.SIGSTOP)
        assert "has not reported for" in workers.target.log_tail(10**6)
