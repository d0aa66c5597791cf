"""Prefill time of the 8B-shaped target (or a draft shape): tokens/s and TFLOP/s.

Batches of prompts of one length; prompts of mixed lengths grouped by length against one padded forward."""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

sys.path.insert(0, ".")
from benchmarks.shaped_checkpoint import VOCAB, build  # noqa: E402
from minedraft.engine import sequence_table  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402
from minedraft.engine.sampling import SamplingConfig  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402

ONE_FORWARD = 1 << 40  # a forward cost that puts every prompt in one forward


def prefill_flops(model: PreTrainedModel, batch: int, length: int) -> float:
    """Multiply-adds x 2 of a prefill: every weight but the input embedding once per token, the LM head once per
    prompt (its last token only), and causal attention's two matmuls."""
    config = model.config
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)  # typed as any Module, whose weight could be a Module
    embedding = embeddings.weight.numel()
    head = model.get_output_embeddings().weight
    body = sum(p.numel() for p in model.parameters()) - embedding - (0 if head is embeddings.weight else head.numel())
    head_dim = config.hidden_size // config.num_attention_heads
    attention = 2 * length * length * head_dim * config.num_attention_heads * config.num_hidden_layers  # causal half
    return batch * (2 * body * length + 2 * head.numel() + attention)


def parse_lengths(spec: str) -> list[int]:
    """Prompt lengths from a spec such as `2000,100*15` (one of 2000 tokens, 15 of 100): `L*N` is N prompts of L."""
    lengths: list[int] = []
    for part in spec.split(","):
        length, _, count = part.partition("*")
        lengths += [int(length)] * int(count or 1)
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8b", choices=["8b", "1b", "68m"])
    parser.add_argument("--batches", default="1,8,16,24,32,39,48,64", help="prompts per prefill (empty: none)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument(
        "--mixed",
        default="2000,100*15;1500*2,500*6,100*8;512*16",
        help="prefills of prompts of mixed lengths (`;` between prefills, `L*N`: N prompts of L "
        "tokens), each grouped by length (the workers' default) and in one padded forward, "
        "side by side (empty: none)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile'd decoder layers (as --compile serves)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument(
        "--profile", action="store_true", help="then profile one prefill of one prompt: the host's costliest calls"
    )
    parser.add_argument(
        "--blas",
        default="",
        help="BLAS libraries to compare on the batches, alternating (e.g. "
        "cublas,cublaslt; empty: the process's, which eager forwards use)",
    )
    args = parser.parse_args()
    device = args.device
    model = build(args.shape, device)
    batches = [int(b) for b in args.batches.split(",") if b]
    mixed = [parse_lengths(spec) for spec in args.mixed.split(";") if spec]
    runner = ModelRunner(model, max(batches + [len(m) for m in mixed]), 2048, compile_layers=args.compile)
    verifier = Verifier(runner, [])
    if args.compile:
        verifier.warm_up(4)
    generator = torch.Generator().manual_seed(0)
    config = SamplingConfig(max_tokens=1, ignore_eos=True)

    def prefill_seconds(prompts: list[list[int]], forward_cost: int) -> float:
        sequence_table.PREFILL_FORWARD_COST = forward_cost
        seqs = list(range(len(prompts)))
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        verifier.prefill(seqs, prompts, [config] * len(prompts)).per_row()  # the host reads the first tokens
        seconds = time.perf_counter() - start
        verifier.release(seqs)
        return seconds

    grouped_cost = sequence_table.PREFILL_FORWARD_COST
    print(
        f"{args.shape} prefill, {'compiled' if args.compile else 'uncompiled'} layers, median of {args.repeats}",
        flush=True,
    )
    libraries = args.blas.split(",") if args.blas else [""]

    def random_prompts(lengths: list[int]) -> list[list[int]]:
        """New prompts for every prefill: the prefix cache holds those prefilled before."""
        return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]

    for batch in batches:
        runs: dict[str, list[float]] = {library: [] for library in libraries}
        for repeat in range(args.repeats + 1):  # the first: allocations, and a compile of a new size
            for library in libraries if repeat % 2 else libraries[::-1]:
                if library:
                    torch.backends.cuda.preferred_blas_library(library)
                runs[library].append(prefill_seconds(random_prompts([args.prompt_len] * batch), grouped_cost))
        for library, measured in runs.items():
            seconds, tokens = statistics.median(measured[1:]), batch * args.prompt_len
            print(
                f"B={batch:3d} x {args.prompt_len}{' ' + library if library else ''}: {seconds * 1e3:8.1f} ms  "
                f"{tokens / seconds:8.0f} prompt tok/s  "
                f"{prefill_flops(model, batch, args.prompt_len) / seconds / 1e12:6.0f} TFLOP/s",
                flush=True,
            )
    for lengths in mixed:
        times: dict[int, list[float]] = {grouped_cost: [], ONE_FORWARD: []}
        for repeat in range(args.repeats + 1):
            for cost in (grouped_cost, ONE_FORWARD) if repeat % 2 else (ONE_FORWARD, grouped_cost):
                times[cost].append(prefill_seconds(random_prompts(lengths), cost))
        grouped, one = (statistics.median(times[c][1:]) for c in (grouped_cost, ONE_FORWARD))
        groups = sequence_table.prefill_groups(lengths, grouped_cost)
        padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
        print(
            f"{len(lengths)} prompts, {sum(lengths)} tokens: grouped {grouped * 1e3:8.1f} ms ({len(groups)} "
            f"forwards, {padded} tokens computed), one forward {one * 1e3:8.1f} ms ({len(lengths) * max(lengths)} "
            f"tokens computed): {one / grouped:.2f}x",
            flush=True,
        )
    if args.profile:
        profile_one_prefill(lambda: prefill_seconds(random_prompts([args.prompt_len]), grouped_cost), device)


def profile_one_prefill(prefill_seconds: Callable[[], float], device: str) -> None:
    """Where one prefill's host time goes: the host's costliest operations (with CUDA's API calls on a GPU), the
    Python functions under cProfile, and on a GPU each line that made the host wait for the device."""
    prefill_seconds()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        seconds = prefill_seconds()
    print(f"one prompt, profiled: {seconds * 1e3:.1f} ms; the host's costliest calls:")
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    functions = cProfile.Profile()
    seconds = functions.runcall(prefill_seconds)
    print(f"the same under cProfile: {seconds * 1e3:.1f} ms; by time in each function itself:")
    pstats.Stats(functions).sort_stats("tottime").print_stats(20)
    if not device.startswith("cuda"):
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            seconds = prefill_seconds()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"the same, the host waiting for the device ({seconds * 1e3:.1f} ms) {sum(waits.values())} times:")
    for line, count in waits.most_common():
        print(f"  {count:4d}  {line}")


if __name__ == "__main__":
    main()
