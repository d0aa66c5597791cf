"""The host's grammar work a token at a wide vocabulary: a tiny Llama 128,256 tokens wide, the demo tokenizer.

The GPU's `grammar` stage serves an 8B-shaped target (vocab 128,256) with the demo tokenizer (4,096 tokens); this runs
the same widths on a CPU, in process (`generate_offline`, one batch), so the target's host can be timed apart from a
GPU: a tiny target (hidden 64, 2 layers) and draft (hidden 32, 1 layer), random weights, greedy, EOS ignored, under
`grammar_served_bench.py`'s schema (a list of at least 32 strings: every token constrained) and without it. It prints
per output token the process's CPU, and the time in each `Grammars` call (the target's masks before a verify, its
matchers advanced after; the draft's masks between its forwards):

    python benchmarks/grammar_host_bench.py [--batch 8] [--k 0,4] [--output-len 96] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path.cwd()))  # the tree it runs in, not this file's
from benchmarks.grammar_served_bench import SCHEMA  # noqa: E402
from draft_service.proposer import Proposer  # noqa: E402
from minedraft.demo_models import TARGET_DIR  # noqa: E402
from minedraft.engine.grammar import Grammars  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402
from minedraft.engine.models import load_tokenizer  # noqa: E402
from minedraft.engine.sampling import SamplingConfig  # noqa: E402
from minedraft_app.offline import OfflineRequest, generate_offline  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402

TIMED = ("admit", "first_masks", "masks", "advance", "draft_masks", "rollback_drafts")
spent: collections.defaultdict[str, float] = collections.defaultdict(float)


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start

    return call


def _model(vocab: int, hidden: int, layers: int, seed: int) -> Any:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", default="0,4", help="drafts a verify (0: the target alone, as psd's auto mostly runs)")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--vocab", type=int, default=128256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in TIMED:
        setattr(Grammars, name, _timed(name, getattr(Grammars, name)))
    tokenizer = load_tokenizer(str(TARGET_DIR))
    eos = [tokenizer.eos_token_id]
    target, draft = _model(args.vocab, 64, 2, 0), _model(args.vocab, 32, 1, 1)
    prompts = [tokenizer.encode(f"Write {i} lines of a JSON list about topic number {i}.") for i in range(args.batch)]
    length = max(len(p) for p in prompts) + args.output_len + 16
    spec = ("json_schema", json.dumps(SCHEMA), False)
    print(f"vocab {args.vocab} (tokenizer {len(tokenizer)}), batch {args.batch}, {args.output_len} tokens out")
    for k in (int(k) for k in args.k.split(",")):
        verifier = Verifier(ModelRunner(target, args.batch, length), eos, tokenizer=tokenizer)
        proposer = None
        if k:
            proposer = Proposer(ModelRunner(draft, args.batch, length), eos_token_ids=eos, tokenizer=tokenizer)
        verifier.grammars.compile(spec)  # (once per grammar: not a step's cost)
        if proposer is not None and proposer.grammars is not None:
            proposer.grammars.compile(spec)
        for label, grammar in (("unconstrained", None), ("schema", spec)):
            config = SamplingConfig(max_tokens=args.output_len, ignore_eos=True, grammar=grammar)
            requests = [OfflineRequest(p, config) for p in prompts]
            generate_offline(verifier, proposer, requests[:1], k, args.batch)  # warm
            spent.clear()
            cpu, wall = time.process_time(), time.perf_counter()
            results = generate_offline(verifier, proposer, requests, k, args.batch)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            tokens = sum(len(r.tokens) for r in results)
            parts = ", ".join(f"{n} {spent[n] / tokens * 1e3:.3f}" for n in TIMED if spent[n])
            print(
                f"k={k} {label}: {tokens} tokens, CPU {cpu / tokens * 1e3:.3f} ms a token (wall "
                f"{wall / tokens * 1e3:.3f}); grammar calls, ms a token: {parts or 'none'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
