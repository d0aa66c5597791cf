"""The EAGLE drafter's proposal time per batch size, in process: a head from its checkpoint, random target states.

Each step runs as the draft service sees it: the target's states of the positions the last verify kept (a random
accepted count of k drafts, plus the verified token), then a proposal. Prints the median proposal time per
batch (wall and CPU time: the CPU time holds on a busy machine with --threads 1), and the CPU time of handing it the
states. On CUDA the draft steps replay CUDA graphs, captured before the timing (`precapture`); --eager runs them
eagerly.

    python benchmarks/eagle_proposal_bench.py --target minedraft/demo_models/target --head /tmp/eb-eagle3 \
        --batches 1,4,16,64 --k 4
    python benchmarks/eagle_proposal_bench.py ... --device cuda --dtype bfloat16 [--eager]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draft_service.eagle import EagleProposer  # noqa: E402
from draft_service.eagle_head import load_eagle_head  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--head", required=True)
    parser.add_argument("--eagle1", action="store_true", help="an EAGLE-1 head (default: EAGLE-3)")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs of the draft steps")
    parser.add_argument("--profile", action="store_true", help="then where one batch's proposals spend their time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    head, spec = load_eagle_head(args.head, args.target, not args.eagle1, dtype)
    head = head.to(args.device)
    width = head.embed.embedding_dim * len(spec.layers)
    vocab = head.embed.num_embeddings
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        gen = torch.Generator().manual_seed(batch)
        proposer = EagleProposer(head, spec, num_slots=batch, cuda_graphs=not args.eager)
        captured = proposer.precapture(args.k, batch)
        ids = list(range(batch))
        prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist() for _ in ids]
        proposer.add_hidden(ids, [torch.randn(args.prompt_len, width, generator=gen) for _ in ids], admitting=True)
        proposer.prefill(ids, prompts, [])
        accepted = torch.zeros(batch, dtype=torch.long)
        times, cpu_times, states_times = [], [], []  # (CPU time: the same on a busy machine, with --threads 1)
        for _ in range(args.steps):
            tokens = torch.randint(1, vocab, (batch,), generator=gen)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start, start_cpu = time.perf_counter(), time.thread_time()
            proposal = proposer.propose(ids, accepted, tokens, args.k)
            proposal.draft_ids.tolist()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.thread_time() - start_cpu)
            accepted = torch.randint(0, args.k + 1, (batch,), generator=gen)
            states = [torch.randn(int(a) + 1, width, generator=gen) for a in accepted]
            start = time.thread_time()
            proposer.add_hidden(ids, states)
            states_times.append(time.thread_time() - start)
        median, cpu = statistics.median(times[2:]) * 1e3, statistics.median(cpu_times[2:]) * 1e3
        states_cpu = statistics.median(states_times[2:]) * 1e3
        results[batch] = {"wall_ms": round(median, 2), "cpu_ms": round(cpu, 2), "states_cpu_ms": round(states_cpu, 2)}
        graphs = len(proposer.graphs.graphs) if proposer.graphs is not None else 0
        print(
            f"batch {batch:3d}: proposal {median:7.2f} ms, CPU {cpu:7.2f} ms; its states' CPU {states_cpu:6.2f} ms"
            f" (medians, k={args.k}; {graphs} CUDA graphs, {captured} captured ahead)",
            flush=True,
        )
    print(json.dumps(results))
    if args.profile:
        profile_proposals(proposer, ids, args.k, vocab, width, args.device)


def profile_proposals(proposer: EagleProposer, ids: list[int], k: int, vocab: int, width: int, device: str) -> None:
    """The last batch's proposals under torch's profiler: the ops by their own time, and their shapes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    accepted = torch.zeros(len(ids), dtype=torch.long)
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(3):
            proposer.propose(ids, accepted, torch.randint(1, vocab, (len(ids),)), k).draft_ids.tolist()
            proposer.add_hidden(ids, [torch.randn(1, width) for _ in ids])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=12), flush=True)


if __name__ == "__main__":
    main()
