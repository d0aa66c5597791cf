"""On CUDA, between real services: cuda-ipc and nccl give the grpc channel's output, and greedy rows equal generate().

The target runs on the first GPU and the draft on the last one: two GPUs when the machine has them (the nccl
channel needs two; NCCL refuses two ranks on one GPU), else both on one. Skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from stack import TinyPairs, Workers, generate_all, mixed_requests, run_async, running_coordinator, start_workers

pytest_plugins = ["stack"]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def gpu_workers(tiny_pairs: TinyPairs, stack_logs: Path) -> Iterator[Workers]:
    last = f"cuda:{torch.cuda.device_count() - 1}"
    workers = start_workers(tiny_pairs["gpt2"], stack_logs, target_device="cuda:0", draft_device=last)
    try:
        yield workers
    finally:
        workers.stop()


def _generate_reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    # typeshed types the @functools.wraps-decorated PreTrainedModel.to as unbound: it wants the model as argument 1.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda:0").eval()  # type: ignore[arg-type]
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda:0")
            tokens = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
            out.append(tokens[0, len(prompt) :].tolist())
    return out


def test_gpu_channels_move_drafts_exactly(tiny_pairs: TinyPairs, gpu_workers: Workers, stack_logs: Path) -> None:
    requests = mixed_requests(tiny_pairs.tokenizer, MAX_TOKENS)
    # nccl last: a worker pair joins one NCCL group for its lifetime.
    channels = ["grpc", "cuda-ipc"] + (["nccl"] if torch.cuda.device_count() > 1 else [])
    outputs = {}
    for channel in channels:
        # Drafting at every step: `--speculation auto` decodes without drafts while that measures faster, and a
        # seeded sample of the target alone is another draw than one through acceptance.
        extra = ["--channel", channel, "--speculation", "always"]
        with running_coordinator(gpu_workers, stack_logs, "psd", extra=extra) as coordinator:
            outputs[channel] = run_async(generate_all(coordinator.address, requests))
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs["grpc"])
    for channel in channels[1:]:
        assert outputs[channel] == outputs["grpc"], f"{channel} changed the output"
    greedy = [i for i, r in enumerate(requests) if r.params.temperature == 0]
    expected = _generate_reference(tiny_pairs["gpt2"].target, [list(requests[i].prompt_token_ids) for i in greedy])
    assert [outputs["grpc"][i] for i in greedy] == expected
