"""Host time of a verify and a proposal before their launch and after it, on a CPU, A/B between two trees.

A step on the GPU waits for the host work before its launch; the host work after it runs while the GPU does (or, on a
host-bound stack, adds to it). This times both on a tiny Llama pair (the host's bookkeeping does not depend on the
model's size), with the forward itself taken out: `ModelRunner._launch` is timed and left out. The code it calls has
been the same since the slot cache (607e410), so it runs on either tree:

    python benchmarks/host_prep_bench.py                              # this tree
    git worktree add /tmp/slot 607e410
    python benchmarks/host_prep_bench.py --against /tmp/slot          # that tree, this, this, that; and the ratios

It prints per batch and step the median microseconds before the launch and after it, over `--steps` steps. A
proposal's "after" ends where the draft service replies: where the tree's proposer leaves its upkeep for after the
reply (`defer_upkeep`), that runs untimed, as the service runs it.
"""

from __future__ import annotations

import argparse
import inspect
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path.cwd()))  # the tree it runs in, not this file's
from draft_service.proposer import Proposer  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402
from minedraft.engine.sampling import SamplingConfig  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402

VOCAB = 256


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


class LaunchClock:
    """Wraps a runner's `_launch`: when the last one began and ended."""

    def __init__(self, runner: ModelRunner) -> None:
        self.began = self.ended = 0.0
        launch = runner._launch

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.began = time.perf_counter()
            try:
                return launch(*args, **kwargs)
            finally:
                self.ended = time.perf_counter()

        runner._launch = timed  # type: ignore[method-assign]

    def since(self, start: float) -> tuple[float, float]:
        """(us from `start` to the last launch, us from its end to now): a step's host time before and after it."""
        return (self.began - start) * 1e6, (time.perf_counter() - self.ended) * 1e6


LINE = re.compile(r"B=\s*(\d+) (\w+) +host before launch +([\d.]+) us, after +([\d.]+) us")


def against(other: str, args: argparse.Namespace) -> None:
    """This file run in `other` and in this tree, in the order other, this, this, other (the later half meets a
    warmer or busier host); medians of each side's two runs and this tree's over the other's."""
    here = str(Path(__file__).resolve().parents[1])
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--batches",
        args.batches,
        "--steps",
        str(args.steps),
        "--k",
        str(args.k),
    ]
    runs: dict[str, list[dict[tuple[int, str], tuple[float, float]]]] = {other: [], here: []}
    for tree in (other, here, here, other):
        output = subprocess.run(command, cwd=tree, check=True, capture_output=True, text=True).stdout
        found = [LINE.match(line) for line in output.splitlines()]
        runs[tree].append({(int(m[1]), m[2]): (float(m[3]), float(m[4])) for m in found if m})
        print(f"ran in {tree}", flush=True)
    print(f"{'step':>12} {'before launch, us':>32} {'after launch, us':>32}")
    for key in runs[here][0]:
        cells = []
        for phase in (0, 1):
            theirs = statistics.median(r[key][phase] for r in runs[other])
            ours = statistics.median(r[key][phase] for r in runs[here])
            cells.append(f"{theirs:8.1f} -> {ours:8.1f} ({ours / theirs:4.2f}x)")
        print(f"B={key[0]:3d} {key[1]:7s} {cells[0]:>32} {cells[1]:>32}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--against", help="another tree (a checkout) to run the same steps in, alternating")
    args = parser.parse_args()
    if args.against:
        against(args.against, args)
        return
    torch.set_num_threads(1)
    k = args.k
    for batch in [int(b) for b in args.batches.split(",")]:
        verifier = Verifier(ModelRunner(tiny_llama(0), batch, 4096), [], synthetic_acceptance=0.7)
        proposer = Proposer(ModelRunner(tiny_llama(1), batch, 4096))
        v_clock, d_clock = LaunchClock(verifier.runner), LaunchClock(proposer.runner)
        seqs = list(range(batch))
        generator = torch.Generator().manual_seed(2)
        prompts = torch.randint(0, VOCAB, (batch, 100), generator=generator).tolist()
        configs = [SamplingConfig(max_tokens=10**6, ignore_eos=True, seed=s + 1) for s in seqs]
        first = verifier.prefill(seqs, prompts, configs).per_row()
        proposer.prefill(seqs, prompts, configs)
        accepted = torch.zeros(batch, dtype=torch.long)
        last = torch.tensor([tokens[-1] for tokens, _, _ in first])
        times: dict[str, list[tuple[float, float]]] = {"propose": [], "verify": []}
        served: dict[str, Any] = {}  # as the draft service proposes, where the tree's proposer can
        if "defer_upkeep" in inspect.signature(proposer.propose).parameters:
            served["defer_upkeep"] = True
        for step in range(args.steps):
            start = time.perf_counter()
            proposal = proposer.propose(seqs, accepted, last, k, **served)
            d_times = d_clock.since(start)
            upkeep = getattr(proposal, "upkeep", None)
            if upkeep is not None:
                upkeep()  # after the reply, in the service
            start = time.perf_counter()
            result = verifier.verify(seqs, proposal.draft_ids, None).per_row()  # read: its recorder runs, as served
            v_times = v_clock.since(start)
            if step >= 10:  # past the first steps' allocations
                times["propose"].append(d_times)
                times["verify"].append(v_times)
            accepted = torch.tensor([a for _, a, _ in result])
            last = torch.tensor([tokens[-1] for tokens, _, _ in result])
        for name, pairs in times.items():
            before = statistics.median(p[0] for p in pairs)
            after = statistics.median(p[1] for p in pairs)
            print(f"B={batch:3d} {name:7s} host before launch {before:7.1f} us, after {after:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
