"""EAGLE heads through the services: greedy output equals HF `generate()` of the target in psd, sd and ar, with an
EAGLE-3 head on a Llama target and an EAGLE-1 head on a Qwen3 target (random weights in the published formats),
the target's hidden states travelling back to the draft over the channel."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from reference import hf_greedy
from safetensors.torch import save_file
from stack import (
    TinyPairs,
    Workers,
    assert_all_slots_free,
    generate,
    in_process_coordinator,
    run_async,
    spawn,
    stop_all,
    text_prompts,
    wait_all,
    worker_args,
    worker_info,
)

from minedraft.engine.models import load_tokenizer
from minedraft.proto import generation_pb2, generation_pb2_grpc

pytest_plugins = ["stack"]

WORKER_BATCH = 4
NUM_REQUESTS = 8
K = 3
HEADS = {"llama": True, "qwen3": False}  # arch -> EAGLE-3 (else EAGLE-1)
# The Llama target's KV cache: 16 blocks of 16 tokens (512 bytes a token, one the trash block), so that the n > 1
# test's load (8 sequences of ~100 tokens, 4 at a time) must preempt; the other tests' fit or preempt a little.
SMALL_POOL_GIB = 16 * 16 * 512 / 2**30
DRAFT_ARGS: dict[str, list[str]] = {}  # arch -> its draft service's arguments (a restart takes them again)


def write_head(directory: Path, target: Path, eagle3: bool) -> Path:
    """A head of random weights for `target` in its published format: EAGLE-3 (safetensors, `midlayer.*`, a draft
    vocabulary of half the target's, reading layers 0, 1 and 2) or EAGLE-1 (pytorch_model.bin, `layers.0.*`)."""
    config = json.loads((target / "config.json").read_text())
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], 16
    g = torch.Generator().manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    attn_in = 2 * hidden if eagle3 else hidden
    prefix = "midlayer." if eagle3 else "layers.0."
    tensors = {
        "fc.weight": rand(hidden, (3 if eagle3 else 2) * hidden),
        prefix + "self_attn.q_proj.weight": rand(heads * head_dim, attn_in),
        prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, attn_in),
        prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, attn_in),
        prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": rand(2 * hidden, hidden),
        prefix + "mlp.up_proj.weight": rand(2 * hidden, hidden),
        prefix + "mlp.down_proj.weight": rand(hidden, 2 * hidden),
        prefix + "post_attention_layernorm.weight": 1 + rand(hidden),
    }
    head: dict[str, Any] = dict(
        architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
        model_type="llama",
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_hidden_layers=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        vocab_size=vocab,
    )
    directory.mkdir()
    if eagle3:
        ids = torch.randperm(vocab, generator=g)[: vocab // 2].sort().values
        tensors |= {
            "midlayer.input_layernorm.weight": 1 + rand(hidden),
            "midlayer.hidden_norm.weight": 1 + rand(hidden),
            "norm.weight": 1 + rand(hidden),
            "lm_head.weight": rand(vocab // 2, hidden) * 5,
            "d2t": ids - torch.arange(vocab // 2),
        }
        head |= {"draft_vocab_size": vocab // 2, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        torch.save(tensors, directory / "pytorch_model.bin")
    (directory / "config.json").write_text(json.dumps(head))
    return directory


@pytest.fixture(scope="module")
def eagle_workers(tiny_pairs: TinyPairs, stack_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Per architecture: its target, and a draft service running an EAGLE head on it (`--speculative-method auto`)."""
    root = tmp_path_factory.mktemp("eagle-heads")
    workers: dict[str, Workers] = {}
    try:
        for arch, eagle3 in HEADS.items():
            pair = tiny_pairs[arch]
            head = write_head(root / arch, pair.target, eagle3)
            pool = ["--kv-cache-memory", str(SMALL_POOL_GIB)] if arch == "llama" else []
            target = spawn(f"eagle-{arch}-target", worker_args("target", pair.target, WORKER_BATCH) + pool, stack_logs)
            DRAFT_ARGS[arch] = worker_args("draft", head, WORKER_BATCH) + ["--target-model-for-draft", str(pair.target)]
            draft = spawn(f"eagle-{arch}-draft", DRAFT_ARGS[arch], stack_logs)
            workers[arch] = Workers(pair, target, draft, WORKER_BATCH)
        wait_all([s for w in workers.values() for s in (w.target, w.draft) if s is not None])
        yield workers
    finally:
        stop_all([s for w in workers.values() for s in (w.draft, w.target)])  # (a restarted draft: the current one)


Timed = list[tuple[generation_pb2.GenerateRequest, float]]  # requests, each with its start delay


def _requests(pairs: TinyPairs, arch: str) -> tuple[Timed, list[list[int]]]:
    """Greedy requests with start delays (they join and leave mid-flight), two of them with a prompt that starts
    as the other's (a prefix-cache hit on the target), and each one's HF `generate()` tokens."""
    from transformers import AutoModelForCausalLM

    pair = pairs[arch]
    rng = random.Random(5)
    prompts = text_prompts(load_tokenizer(str(pair.target)), NUM_REQUESTS, 4, 40, seed=6)
    shared = text_prompts(load_tokenizer(str(pair.target)), 1, 40, 40, seed=7)[0]
    prompts[-2:] = [shared + prompts[-2][:3], shared + prompts[-1][:5]]  # a cached prefix's states are needed too
    model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)
    requests, expected = [], []
    for prompt in prompts:
        budget = rng.randint(1, 16)
        expected.append(hf_greedy(model, prompt, budget))
        params = generation_pb2.SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)
        requests.append((generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params), rng.uniform(0, 0.5)))
    return requests, expected


async def _run(address: str, requests: Timed) -> list[Any]:
    async def one(request: generation_pb2.GenerateRequest, delay: float) -> Any:
        await asyncio.sleep(delay)
        return await generate(address, request, timeout=120)

    return list(await asyncio.gather(*(one(r, d) for r, d in requests)))


@pytest.mark.parametrize("arch", list(HEADS))
def test_eagle_greedy_matches_target_alone(arch: str, eagle_workers: dict[str, Workers], tiny_pairs: TinyPairs) -> None:
    workers = eagle_workers[arch]
    assert workers.draft is not None
    assert worker_info(workers.draft.address, "draft").reads_target_states
    requests, expected = _requests(tiny_pairs, arch)

    async def run(mode: str) -> list[Any]:
        async with in_process_coordinator(workers, mode=mode, num_speculative_tokens=K, speculation="always") as (
            address,
            _,
        ):
            return await _run(address, requests)

    for mode in ("psd", "sd", "ar"):
        done = run_async(run(mode))
        assert [c.token_ids for c in done] == expected, mode
        drafted = sum(c.usage.draft_tokens for c in done)
        assert (drafted > 0) == (mode != "ar"), (mode, drafted)
    assert_all_slots_free(workers)
    # Every proposal ran on the target's states: none drafted blind (what a draft back after a loss does).
    assert "no hidden states of the target" not in workers.draft.log_tail(10**7)


def test_eagle_draft_killed_and_restarted(
    eagle_workers: dict[str, Workers], tiny_pairs: TinyPairs, stack_logs: Path
) -> None:
    """kill -9 of the EAGLE draft mid-flight: nothing is lost (the target decodes alone); restarted on its address,
    it is taken back, the running requests handed over without their prompts' states (it drafts their last token
    until a verify's come), and drafts again from the target's states, the output `generate()`'s throughout."""
    workers = eagle_workers["llama"]
    assert workers.draft is not None
    requests, expected = _requests(tiny_pairs, "llama")
    old, restarted = workers.draft, None

    async def run() -> tuple[list[Any], list[Any], list[Any]]:
        nonlocal restarted
        options: dict[str, Any] = dict(
            mode="psd", num_speculative_tokens=K, speculation="always", draft_retry_interval=0.2
        )
        async with in_process_coordinator(workers, **options) as (address, _):
            first = asyncio.create_task(_run(address, requests))
            await asyncio.sleep(0.3)
            old.proc.send_signal(signal.SIGKILL)
            lost = await first
            restarted = spawn("eagle-llama-draft-again", DRAFT_ARGS["llama"], stack_logs, port=old.port)
            await asyncio.to_thread(wait_all, [restarted])
            # Requests running while the draft is taken back, then a wave after.
            during = await _run(address, [(r, 0.1 * i) for i, (r, _) in enumerate(requests)])
            # Waves until one drafts: the hand-back waits on the draft's probe, which a loaded host may delay.
            deadline = time.monotonic() + 60
            after = await _run(address, requests)
            while not sum(c.usage.draft_tokens for c in after) and time.monotonic() < deadline:
                assert [c.token_ids for c in after] == expected
                await asyncio.sleep(0.5)
                after = await _run(address, requests)
            return lost, during, after

    try:
        lost, during, after = run_async(run())
    finally:
        if restarted is not None:
            workers.draft = restarted
    assert old.proc.wait() == -signal.SIGKILL
    for done in (lost, during, after):
        assert [c.token_ids for c in done] == expected
    assert sum(c.usage.draft_tokens for c in after) > 0


def test_eagle_samples_of_a_prompt_preempted_by_a_small_pool(
    eagle_workers: dict[str, Workers], tiny_pairs: TinyPairs
) -> None:
    """n = 2 greedy samples of each prompt with an EAGLE-3 head, under a KV pool too small for the load: the
    coordinator preempts (a preempted sequence is prefilled again, prompt and output, and its states sent again);
    every sample equals `generate()` and the head drafts throughout."""
    from transformers import AutoModelForCausalLM

    workers = eagle_workers["llama"]
    pair = tiny_pairs["llama"]
    prompts = text_prompts(load_tokenizer(str(pair.target)), 4, 50, 70, seed=9)
    model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)
    expected = [hf_greedy(model, prompt, 40) for prompt in prompts]
    params = generation_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def one(address: str, prompt: list[int]) -> tuple[dict[int, list[int]], int]:
        samples: dict[int, list[int]] = {}
        drafted = 0
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params, n=2)
            async for message in stub.Generate(request, timeout=120):
                samples.setdefault(message.index, []).extend(message.token_ids)
                drafted += message.usage.draft_tokens if message.finish_reason else 0
        return samples, drafted

    async def run() -> tuple[list[tuple[dict[int, list[int]], int]], int]:
        async with in_process_coordinator(workers, mode="psd", num_speculative_tokens=K, speculation="always") as (
            address,
            coordinator,
        ):
            done = await asyncio.gather(*(one(address, p) for p in prompts))
            return list(done), coordinator.loop.admission.preemptions

    done, preemptions = run_async(run())
    assert preemptions > 0, "the load never ran short of blocks: the test proves nothing"
    for (samples, _), want in zip(done, expected, strict=True):
        assert samples == {0: want, 1: want}
    assert sum(drafted for _, drafted in done) > 0
    assert_all_slots_free(workers, timeout=15)


def test_eagle_long_prompts_past_the_reverse_buffer(eagle_workers: dict[str, Workers], tiny_pairs: TinyPairs) -> None:
    """A prefill of more prompt positions than the reverse buffer holds (4 prompts of ~150 tokens at once, any two
    past it; the buffer holds one prompt of --max-model-len 256): the target sends each sequence's latest positions,
    the head drafts on them (the earlier ones left out of its keys), and the output is `generate()`'s."""
    from transformers import AutoModelForCausalLM

    workers = eagle_workers["qwen3"]
    pair = tiny_pairs["qwen3"]
    prompts = text_prompts(load_tokenizer(str(pair.target)), 4, 140, 160, seed=12)
    model = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32)
    expected = [hf_greedy(model, prompt, 12) for prompt in prompts]
    params = generation_pb2.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = [(generation_pb2.GenerateRequest(prompt_token_ids=prompt, params=params), 0.0) for prompt in prompts]

    async def run() -> list[Any]:
        async with in_process_coordinator(workers, mode="sd", num_speculative_tokens=K, speculation="always") as (
            address,
            _,
        ):
            return await _run(address, requests)

    done = run_async(run())
    assert [c.token_ids for c in done] == expected
    assert sum(c.usage.draft_tokens for c in done) > 0
    assert "prompt positions' states sent back" in workers.target.log_tail(10**7)


def test_eagle_with_tetris_matches_target_alone(eagle_workers: dict[str, Workers], tiny_pairs: TinyPairs) -> None:
    """TETRIS over an EAGLE head (greedy drafts: scored alike, design section 14): k + 2 drafts a row and a budget
    of 5 over batches of up to 4, so rows verify different prefixes and the head reads the target's states of each
    row's own emitted count; psd gives `generate()`'s tokens, no proposal drafting blind."""
    workers = eagle_workers["llama"]
    assert workers.draft is not None
    requests, expected = _requests(tiny_pairs, "llama")
    logged_before = len(workers.draft.log_tail(10**7))  # (earlier tests' lines: a preempted row may draft blind)

    async def run() -> list[Any]:
        options: dict[str, Any] = dict(
            mode="psd", num_speculative_tokens=K, speculation="always", tetris=True, verify_token_budget=5
        )
        async with in_process_coordinator(workers, **options) as (address, _):
            return await _run(address, requests)

    done = run_async(run())
    assert [c.token_ids for c in done] == expected
    assert_all_slots_free(workers)
    assert "no hidden states of the target" not in workers.draft.log_tail(10**7)[logged_before:]
