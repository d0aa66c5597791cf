"""Per-step cost of a structured output's masking on a CPU: the host's bitmasks and the device side's mask.

A verify of k drafts with constrained rows costs the target's host `Grammars.masks` (per constrained row, k + 1
bitmasks filled by xgrammar, the drafts accepted and rolled back) before its launch, `Grammars.advance` after it,
and in the step `masked_logits` ([B, k + 1, V] unpacked and applied). This times each, on the demo pair's tokenizer
(4096 tokens) under a JSON schema whose answer is a real JSON text, every draft accepted (the most work a step does):

    python benchmarks/grammar_mask_bench.py [--batch 8] [--k 4] [--vocab 128256]

It prints the median microseconds of each part per step; `--vocab` sizes the device side's logits only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path.cwd()))  # the tree it runs in, not this file's
from minedraft.engine.grammar import Grammars, masked_logits  # noqa: E402
from minedraft.engine.models import load_tokenizer  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "minedraft" / "demo_models" / "target"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "count": {"type": "integer"},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "count", "ok"],
    "additionalProperties": False,
}
ANSWER = {"name": "parse_args", "tags": ["cli", "argv", "options"], "count": 12345, "ok": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128256, help="the device side's logits width")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(str(DEMO))
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    spec = ("json_schema", json.dumps(SCHEMA), False)
    start = time.perf_counter()
    grammars.compile(spec)
    print(f"compile: {(time.perf_counter() - start) * 1e3:.1f} ms (vocabulary {len(tokenizer)})")
    text = tokenizer.encode(json.dumps(ANSWER, indent=2)) + [tokenizer.eos_token_id]
    seq_ids = list(range(args.batch))
    host_masks, host_advance, device = [], [], []
    for _ in range(5):
        grammars.release(seq_ids)
        grammars.admit(seq_ids, [spec] * args.batch, [[]] * args.batch)
        position = 0
        while position + args.k + 1 <= len(text):
            drafts = np.array([text[position : position + args.k]] * args.batch)
            start = time.perf_counter()
            masks = grammars.masks(seq_ids, drafts)
            host_masks.append(time.perf_counter() - start)
            emitted = [text[position : position + args.k + 1]] * args.batch
            start = time.perf_counter()
            grammars.advance(seq_ids, emitted)
            host_advance.append(time.perf_counter() - start)
            position += args.k + 1
    logits = torch.randn(args.batch, args.k + 1, args.vocab)
    wide = torch.full((args.batch, args.k + 1, (args.vocab + 31) // 32), -1, dtype=torch.int32)
    wide[..., : masks.shape[-1]] = masks
    for _ in range(50):
        start = time.perf_counter()
        masked_logits(logits, wide)
        device.append(time.perf_counter() - start)
    steps = len(host_masks)
    print(f"batch {args.batch}, k {args.k}, {steps} steps of a {len(text)}-token answer, every draft accepted:")
    for name, times in (("host masks", host_masks), ("host advance", host_advance)):
        per_step = statistics.median(times) * 1e6
        print(f"  {name}: {per_step:.0f} us a step ({per_step / args.batch:.0f} us a row)")
    print(f"  masked_logits [B, k+1, {args.vocab}] on the CPU: {statistics.median(device) * 1e6:.0f} us a step")


if __name__ == "__main__":
    main()
