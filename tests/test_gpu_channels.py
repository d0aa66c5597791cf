"""On CUDA: cuda-ipc (and CuPy's nccl, on two GPUs) carry a step's tensors exactly both ways between two processes,
again after a draft restart; between real services they give the grpc channel's output, and greedy rows equal
generate().

The target runs on the first GPU and the draft on the last one: two GPUs when the machine has them (the nccl
channel needs two; NCCL refuses two ranks on one GPU), else both on one. Skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from stack import TinyPairs, Workers, generate_all, mixed_requests, run_async, running_coordinator, start_workers
from test_channels import LAYOUT, B, K, V, _draft_steps, _target_steps

from minedraft.channels import make_channel

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


def _draft_process(conn: Connection, name: str, device: str) -> None:
    """A draft's side, on its GPU: set up twice (the second, a restarted draft's), three steps each way."""
    torch.cuda.set_device(device)
    for _ in range(2):
        draft = make_channel(name, torch.device(device))
        conn.send_bytes(draft.export(K, B, V, LAYOUT))
        draft.attach_back(conn.recv_bytes())
        _draft_steps(draft, conn.send_bytes, conn.recv_bytes)
        conn.send_bytes(b"done")  # (the target's last send may still be in flight until this side has it)
        draft.close()


def _target_process(conn: Connection, name: str, device: str) -> None:
    torch.cuda.set_device(device)
    for _ in range(2):
        target = make_channel(name, torch.device(device))
        target.attach(conn.recv_bytes())
        conn.send_bytes(target.export_back())
        _target_steps(target, conn.send_bytes, conn.recv_bytes)
        assert conn.recv_bytes() == b"done"
        target.close()


def _gpu_channels() -> list[str]:
    two = torch.cuda.is_available() and torch.cuda.device_count() > 1
    return ["cuda-ipc"] + (["nccl"] if two and importlib.util.find_spec("cupy") is not None else [])


@pytest.mark.parametrize("name", _gpu_channels())
def test_gpu_channel_carries_a_steps_tensors_both_ways_between_processes(name: str) -> None:
    """ids int64, fp32 probabilities to the target; bf16 hidden states, int32 and int64 columns back; exact."""
    context = multiprocessing.get_context("spawn")
    draft_end, target_end = context.Pipe()
    last = f"cuda:{torch.cuda.device_count() - 1}"
    children = [
        context.Process(target=_draft_process, args=(draft_end, name, last)),
        context.Process(target=_target_process, args=(target_end, name, "cuda:0")),
    ]
    for child in children:
        child.start()
    draft_end.close()
    target_end.close()
    for child in children:
        child.join(timeout=180)
    assert [child.exitcode for child in children] == [0, 0]


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
