"""The draft's prefills of a burst sharing a cached prefix, timed one by one: the path each takes and what it costs.

paged_bench's prefix question admits its 64 requests as prefills of 1, 3 and 60 rows (the coordinator's prefix
memory turns on after the second); this runs the same prefills on a 68M-shaped draft (random weights, bf16 on
CUDA, float32 and tiny on a CPU), twice, with a new prefix the second time. A first-use compile shows as a first
round far slower than the second. `python3 benchmarks/prefix_prefill_probe.py [--prefix-len 2000]`
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, ".")
from draft_service.proposer import Proposer  # noqa: E402
from minedraft.engine.model_runner import ModelRunner, Step  # noqa: E402
from minedraft.engine.sampling import SamplingConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-len", type=int, default=2000)
    parser.add_argument("--groups", default="1,3,60", help="rows of each prefill, in order")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    hidden, vocab = (768, 32000) if cuda else (64, 128)
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=2,
        num_attention_heads=12 if cuda else 4,
        num_key_value_heads=12 if cuda else 4,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device, dtype).eval()
    groups = [int(g) for g in args.groups.split(",")]
    runner = ModelRunner(model, 2 * sum(groups), args.prefix_len + 128, kv_cache_memory=1.0 if cuda else 0.05)
    proposer = Proposer(runner)
    shapes: list[tuple[int, int, int | None]] = []
    prepare = runner.prepare

    def recorded(**kwargs: object) -> Step:
        step = prepare(**kwargs)  # type: ignore[arg-type]
        shapes.append((len(step.rows), int(kwargs["tokens"]), step.shape.kv_len))  # type: ignore[call-overload]
        return step

    runner.prepare = recorded  # type: ignore[method-assign]
    rng, seq = random.Random(0), 0
    for round_ in (1, 2):
        shared = [rng.randrange(vocab) for _ in range(args.prefix_len)]
        for rows in groups:
            prompts = [shared + [rng.randrange(vocab) for _ in range(rng.randint(20, 60))] for _ in range(rows)]
            shapes.clear()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            cached = proposer.prefill(list(range(seq, seq + rows)), prompts, [SamplingConfig(max_tokens=16)] * rows)
            if cuda:
                torch.cuda.synchronize()
            took = 1e3 * (time.perf_counter() - start)
            seq += rows
            path = ", ".join(
                f"{b} rows x {n} tokens {'paged' if k is None else f'gathered to {k}'}" for b, n, k in shapes
            )
            print(f"round {round_}: prefill of {rows} rows, {sum(cached)} tokens cached: {took:.1f} ms ({path})")
        proposer.release(list(range(seq)))


if __name__ == "__main__":
    main()
