"""Prefill time of the 8B-shaped target (or a draft shape) on the GPU: batches of prompts, tokens/s and TFLOP/s."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.gpu_bench import VOCAB, build  # noqa: E402
from minedraft.model_runner import ModelRunner  # noqa: E402
from minedraft.sampling import SamplingConfig  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402


def prefill_flops(model: torch.nn.Module, batch: int, length: int) -> float:
    """Multiply-adds x 2 of a prefill: every weight but the input embedding once per token, the LM head once per
    prompt (its last token only), and causal attention's two matmuls."""
    config = model.config
    embedding = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embedding - (0 if head is model.get_input_embeddings().weight
                                                                      else head.numel())
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 2 * length * length * head_dim * config.num_attention_heads * config.num_hidden_layers  # causal half
    return batch * (2 * body * length + 2 * head.numel() + attention)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8b", choices=["8b", "1b", "68m"])
    parser.add_argument("--batches", default="1,8,16,24,32,39,48,64", help="prompts per prefill")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile'd decoder layers (as --compile serves)")
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    device = args.device

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
    model = build(args.shape, device)
    batches = [int(b) for b in args.batches.split(",")]
    runner = ModelRunner(model, max(batches), 2048, compile_layers=args.compile)
    verifier = Verifier(runner, [])
    if args.compile:
        verifier.warm_up(4)
    generator = torch.Generator().manual_seed(0)
    config = SamplingConfig(max_tokens=1, ignore_eos=True)
    print(f"{args.shape} prefill, prompts of {args.prompt_len} tokens, {'compiled' if args.compile else 'uncompiled'}"
          f" layers, median of {args.repeats}", flush=True)
    for batch in batches:
        prompts = torch.randint(0, VOCAB, (batch, args.prompt_len), generator=generator).tolist()
        seqs = list(range(batch))
        times = []
        for repeat in range(args.repeats + 1):  # the first: allocations, and a compile of a new size
            sync()
            start = time.perf_counter()
            verifier.prefill(seqs, prompts, [config] * batch).per_row()
            sync()
            if repeat:
                times.append(time.perf_counter() - start)
            verifier.release(seqs)
        seconds = statistics.median(times)
        tokens = batch * args.prompt_len
        print(f"B={batch:3d}: {seconds * 1e3:8.1f} ms  {tokens / seconds:8.0f} prompt tok/s  "
              f"{prefill_flops(model, batch, args.prompt_len) / seconds / 1e12:6.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
