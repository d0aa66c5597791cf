"""Structured output's served cost: throughput with a JSON schema against without, on one stack per mode.

Each mode's stack (`minedraft bench`'s, so its flags) serves the same prompts in rounds, unconstrained then under a
JSON schema (or the other way, alternating), so both halves meet the same processes, caches and neighbours:

    python benchmarks/grammar_served_bench.py --modes psd,sd --threads 1 --max-batch-size 4 \
        --num-prompts 16 --prompt-len 64 --output-len 64 --rounds 2

The schema asks for an object whose `lines` list holds at least 32 strings, so every one of the `--output-len`
tokens is constrained (`ignore_eos`, as `minedraft bench` sends). It prints, per mode, output tokens/s of each half
(summed over rounds), their ratio, the median of the rounds' ratios, each half's accepted drafts a verify, and
each service's CPU milliseconds an output token (from /proc: steadier than wall time on a shared host).

`--acceptance` also runs the demo pair in this process (sd, greedy, k = 4, `--num-prompts` of the same prompts):
drafts accepted a verify unconstrained, with the schema and the draft masked (as served), and with the schema and
the draft unmasked (a draft without a tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path.cwd()))  # the tree it runs in, not this file's
from minedraft_app import bench  # noqa: E402
from minedraft_app.cli import build_parser  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"lines": {"type": "array", "items": {"type": "string"}, "minItems": 32}},
    "required": ["lines"],
    "additionalProperties": False,
}


def _request(prompt: str, index: int, args: argparse.Namespace, schema: bool) -> Any:
    request = bench._request(prompt, index, args)
    if schema:
        request.params.structured_output.json_schema = json.dumps(SCHEMA)
    return request


async def _load(address: str, prompts: list[str], args: argparse.Namespace, schema: bool) -> tuple[list, float]:
    from minedraft.proto import generation_pb2_grpc
    from minedraft.rpc.security import aio_channel
    from minedraft.rpc.server_utils import CHANNEL_OPTIONS

    async with aio_channel(address, None, CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        warm = [_request(p, len(prompts) + i, args, schema) for i, p in enumerate(prompts[: args.num_warmup])]
        await asyncio.gather(*(bench._one(stub, r, args.timeout) for r in warm))
        pending = iter(list(enumerate(prompts)))
        results: list = []

        async def client() -> None:
            for index, prompt in pending:
                results.append(await bench._one(stub, _request(prompt, index, args, schema), args.timeout))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        return results, time.perf_counter() - start


def _cpu_seconds(pids: list[int]) -> list[float]:
    """Each process's user + system CPU seconds, children included (a worker's ranks), from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = []
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds.append(sum(int(f) for f in fields[11:15]) / ticks)
    return seconds


def acceptance(prompts: list[str], tokenizer: Any, args: argparse.Namespace) -> None:
    """The demo pair in process: accepted drafts a verify unconstrained, under the schema with the draft masked and
    with it unmasked."""
    import torch
    from transformers import AutoModelForCausalLM

    from draft_service.proposer import Proposer
    from minedraft.demo_models import DRAFT_DIR, TARGET_DIR
    from minedraft.engine.model_runner import ModelRunner
    from minedraft.engine.sampling import SamplingConfig
    from minedraft_app.offline import OfflineRequest, generate_offline
    from target_service.verifier import Verifier

    torch.set_num_threads(args.threads or 1)
    target, draft = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32) for d in (TARGET_DIR, DRAFT_DIR))
    eos = [tokenizer.eos_token_id]
    spec = ("json_schema", json.dumps(SCHEMA), False)
    ids = [tokenizer.encode(p) for p in prompts]
    length = max(len(i) for i in ids) + args.output_len + 8
    verifier = Verifier(ModelRunner(target, args.max_batch_size, length), eos, tokenizer=tokenizer)
    for label, grammar, masked in (
        ("unconstrained", None, True),
        ("schema, draft masked", spec, True),
        ("schema, draft unmasked", spec, False),
    ):
        proposer = Proposer(
            ModelRunner(draft, args.max_batch_size, length), eos_token_ids=eos, tokenizer=tokenizer if masked else None
        )
        config = SamplingConfig(max_tokens=args.output_len, ignore_eos=True, grammar=grammar)
        requests = [OfflineRequest(i, config) for i in ids]
        results = generate_offline(verifier, proposer, requests, args.num_speculative_tokens, args.max_batch_size)
        accepted = sum(r.accepted for r in results) / sum(r.steps for r in results)
        print(f"in process, {label}: {accepted:.2f} drafts accepted a verify", flush=True)


def main() -> None:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--rounds", type=int, default=4)
    ours.add_argument("--acceptance", action="store_true", help="also the in-process acceptance, draft (un)masked")
    known, rest = ours.parse_known_args()
    args = build_parser().parse_args(["bench", *rest])
    args.concurrency = args.concurrency or 2 * args.max_batch_size
    tokenizer = bench._load_tokenizer(args.tokenizer or args.target)
    prompts = bench.make_prompts(args.num_prompts, args.prompt_len, args.seed, tokenizer)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="minedraft-grammar-bench-"))
    print(f"{args.num_prompts} prompts, {args.output_len} tokens out, concurrency {args.concurrency}; logs {log_dir}")
    report: dict[str, dict[str, float]] = {}
    for mode in bench._parse_modes(args):
        stack = bench.LocalStack(args, mode, log_dir)
        stack.start()
        pids = [p.pid for p in stack.processes]
        # per half: output tokens, wall seconds, drafted steps, accepted drafts, failures, CPU seconds per process
        totals = {s: {"tokens": 0, "wall": 0.0, "drafted": 0, "accepted": 0, "failed": 0} for s in (False, True)}
        cpu = {s: [0.0] * len(pids) for s in (False, True)}
        ratios = []
        try:
            for round_ in range(known.rounds):
                rate = {}
                for schema in (False, True) if round_ % 2 == 0 else (True, False):
                    before = _cpu_seconds(pids)
                    results, wall = asyncio.run(_load(stack.address, prompts, args, schema))
                    cpu[schema] = [c + b - a for c, a, b in zip(cpu[schema], before, _cpu_seconds(pids), strict=True)]
                    ok = [r for r in results if r.ok]
                    total = totals[schema]
                    tokens = sum(r.completion_tokens for r in ok)
                    rate[schema] = tokens / wall
                    total["tokens"] += tokens
                    total["wall"] += wall
                    total["drafted"] += sum(r.drafted_steps for r in ok)
                    total["accepted"] += sum(r.accepted_tokens for r in ok)
                    total["failed"] += len(results) - len(ok)
                    errors = {r.error for r in results if not r.ok}
                    if errors:
                        print(f"  {mode} schema={schema} errors: {sorted(errors)[:3]}")
                ratios.append(rate[True] / rate[False])
        finally:
            stack.stop()
        plain, constrained = (totals[s]["tokens"] / totals[s]["wall"] for s in (False, True))
        accepted = {s: totals[s]["accepted"] / max(1, totals[s]["drafted"]) for s in (False, True)}
        per_token = {s: [c / totals[s]["tokens"] * 1e3 for c in cpu[s]] for s in (False, True)}
        median = statistics.median(ratios)
        report[mode] = {"plain_tok_s": plain, "schema_tok_s": constrained, "median_round_ratio": median}
        print(
            f"{mode}: {plain:.1f} tok/s unconstrained, {constrained:.1f} with the schema: {constrained / plain:.3f} of "
            f"it (median of the rounds' ratios {median:.3f}: {', '.join(f'{r:.3f}' for r in ratios)}); accepted "
            f"drafts a verify {accepted[False]:.2f} unconstrained, {accepted[True]:.2f} with the schema; failed "
            f"{totals[False]['failed']}/{totals[True]['failed']}\n  CPU ms an output token (target, draft, "
            f"coordinator): {', '.join(f'{c:.2f}' for c in per_token[False])} unconstrained, "
            f"{', '.join(f'{c:.2f}' for c in per_token[True])} with the schema",
            flush=True,
        )
    print(json.dumps(report))
    if known.acceptance:
        acceptance(prompts, tokenizer, args)


if __name__ == "__main__":
    main()
