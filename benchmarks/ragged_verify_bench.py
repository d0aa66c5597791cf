"""TETRIS's verify on a CPU: ragged (only each row's selected drafts run) against padded and against uniform rows.

    python benchmarks/ragged_verify_bench.py                      # B=16, k=4, E=4, a random Llama of hidden 384
    python benchmarks/ragged_verify_bench.py --batch 16 --k 4 --extra 4 --repeats 40 --threads 1
    python benchmarks/ragged_verify_bench.py --device cuda --dtype bfloat16 --hidden 4096 --layers 8 --vocab 128256

One verify step of `Verifier.verify` (forward, acceptance, commit, the host's read) on B rows of a random Llama
built from a config, in-process, each variant on a runner and cache of its own, the variants alternating within
each repeat so that machine noise hits all alike. Printed: each variant's verified positions and median ms, of the
process's CPU time (`time.process_time`, which other jobs on shared cores do not inflate; with one intra-op thread,
the step's compute) and of the wall clock:
- padded: TETRIS's rows (half of them k + E drafts, half none: k x B drafts in all) at k + E + 1 positions a row;
- ragged: the same rows, only each row's pending token and selected drafts (sum over rows of length + 1);
- uniform: plain SD's verify of k drafts a row, the same total positions as ragged;
- ragged-even: TETRIS's rows each of k drafts (the budget spread evenly), which the verify now runs as plain SD's
  (`selected_verify.selected_shape`): what TETRIS costs the target where acceptance does not vary;
- ragged-layout (paged K/V only, on CUDA): ragged's rows through the padded [B, k + E + 1] layout of its queries
  instead of the ragged kernel (`attention.RAGGED_PAGED` off), as before that kernel.
On CUDA the verifies run as CUDA graphs (captured in the two warm-up repeats); read the wall clock there. The drafts
are random (almost all rejected), so each step grows every row by one token: the key lengths stay within
one bucket over the repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from minedraft.engine import attention
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from target_service.verifier import Verifier


def random_llama(hidden: int, layers: int, vocab: int, head_dim: int = 64) -> LlamaForCausalLM:
    """A random Llama of `hidden` (heads of `head_dim`; K/V heads: the largest divisor of the heads up to a third of
    them and 8, so 128 at hidden 4096 gives the 8B's 32 heads over 8), float32, SDPA attention."""
    torch.manual_seed(0)
    heads = hidden // head_dim
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(d for d in range(1, min(heads // 3, 8) + 1) if heads % d == 0) if heads >= 3 else 1,
        head_dim=head_dim,
        intermediate_size=hidden * 8 // 3,
        vocab_size=vocab,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def variant_drafts(name: str, batch: int, k: int, extra: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A variant's draft ids [B, width]: random tokens, -1 past each selected row's length."""
    if name == "uniform":
        return torch.randint(0, vocab, (batch, k), generator=gen)
    drafts = torch.randint(0, vocab, (batch, k + extra), generator=gen)
    if name == "ragged-even":
        lengths = torch.full((batch,), k)
    else:  # half the rows all k + E drafts, half none: k x B drafts in all where E = k
        lengths = torch.where(torch.arange(batch) % 2 == 0, k + extra, 0)
        lengths = lengths * (k * batch) // max(int(lengths.sum()), 1)
    drafts[torch.arange(k + extra)[None, :] >= lengths[:, None]] = -1
    return drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--extra", type=int, default=4, help="E: TETRIS's extra proposals a row")
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64, help="128 with --hidden 4096: the 8B's 32 heads over 8")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--prompt", type=int, default=96, help="tokens a row holds before the first verify")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (1: steadiest on a busy box)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="each variant's K/V (None: the engine's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs (each kernel seen by --profile)")
    parser.add_argument("--profile", action="store_true", help="then each variant's kernels by their GPU time")
    parser.add_argument("--profile-rows", type=int, default=14, help="kernels listed a variant with --profile")
    parser.add_argument("--max-rows", type=int, default=None, help="folded queries a kernel program (MAX_ROWS)")
    parser.add_argument("--ragged-rows", type=int, default=None, help="the same in ragged steps (RAGGED_ROWS)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.max_rows is not None or args.ragged_rows is not None:
        from minedraft.kernels import decode_attention  # (Triton: GPU machines)

        decode_attention.MAX_ROWS, decode_attention.RAGGED_ROWS = args.max_rows, args.ragged_rows
    with torch.device(args.device):  # (initialized where it runs: an 8B-shaped layer stack takes minutes on a CPU)
        model = random_llama(args.hidden, args.layers, args.vocab, args.head_dim).to(getattr(torch, args.dtype))
    names: tuple[str, ...] = ("padded", "ragged", "uniform", "ragged-even")
    if attention.KERNELS is not None and str(args.device).startswith("cuda"):
        names += ("ragged-layout",)
    seq_ids = list(range(args.batch))
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=gen).tolist()
    configs = [SamplingConfig(max_tokens=10_000) for _ in seq_ids]
    verifiers: dict[str, Verifier] = {}
    for name in names:
        runner = ModelRunner(
            model,
            args.batch,
            args.prompt + args.repeats + 64 + (3 if args.profile else 0),
            cuda_graphs=not args.eager,
            kv_cache_memory=args.kv_cache_gib,
        )
        verifier = Verifier(runner, [])
        verifier.ragged_verifies = name != "padded"
        if name.startswith("ragged"):  # (as served: both draft counts prepared, selected drafts cut to the fewer)
            verifier.verify_widths = (args.k, args.k + args.extra)
        verifier.prefill(seq_ids, prompts, configs).per_row()
        verifiers[name] = verifier
    times: dict[str, list[float]] = {name: [] for name in names}
    walls: dict[str, list[float]] = {name: [] for name in names}
    positions: dict[str, int] = {}
    for repeat in range(args.repeats + 2):  # (the first two warm up)
        for name in names:
            drafts = variant_drafts(name, args.batch, args.k, args.extra, args.vocab, gen)
            selected = name != "uniform"
            width = drafts.shape[1] + 1
            positions[name] = args.batch * width if name == "padded" else int((drafts >= 0).sum()) + args.batch
            attention.RAGGED_PAGED = name != "ragged-layout"
            start, clock = time.process_time(), time.perf_counter()
            verifiers[name].verify(seq_ids, drafts, None, selected=selected).per_row()
            if repeat >= 2:
                times[name].append(time.process_time() - start)
                walls[name].append(time.perf_counter() - clock)
    paged = verifiers["uniform"].runner.step_shape(args.batch, args.prompt, args.k + args.extra + 1)[1] is None
    print(
        f"B={args.batch} k={args.k} E={args.extra}, Llama hidden {args.hidden} x {args.layers} layers "
        f"({model.config.num_attention_heads} heads over {model.config.num_key_value_heads}), vocab "
        f"{args.vocab}, {args.prompt}-token rows, {args.device} {args.dtype}, {args.threads} thread(s), median of "
        f"{args.repeats}; a row of k + E + 1 tokens reads K/V {'paged' if paged else 'gathered'}"
    )
    medians = {name: statistics.median(times[name]) * 1e3 for name in names}
    wall = {name: statistics.median(walls[name]) * 1e3 for name in names}
    for name in names:
        print(f"  {name:12s} {positions[name]:4d} positions  CPU {medians[name]:8.2f} ms  wall {wall[name]:8.2f} ms")
    pairs = [("ragged", "padded"), ("ragged", "uniform"), ("ragged-even", "uniform"), ("ragged-layout", "uniform")]
    for a, b in pairs[: len(names)]:
        print(f"  {a} / {b}: CPU {medians[a] / medians[b]:.3f}  wall {wall[a] / wall[b]:.3f}")
    if args.profile:
        for name in names:
            profile_variant(name, verifiers[name], seq_ids, args, gen)


def profile_variant(
    name: str, verifier: Verifier, seq_ids: list[int], args: argparse.Namespace, gen: torch.Generator
) -> None:
    """Three more verifies of a variant under torch's profiler: its kernels (or ops) by their own time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = str(args.device).startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    attention.RAGGED_PAGED = name != "ragged-layout"
    with profile(activities=activities) as prof:
        for _ in range(3):
            drafts = variant_drafts(name, args.batch, args.k, args.extra, args.vocab, gen)
            verifier.verify(seq_ids, drafts, None, selected=name != "uniform").per_row()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"== {name}: three verifies")
    print(prof.key_averages().table(sort_by=sort, row_limit=args.profile_rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
