"""Step times in process on the GPU: T_d, T_v and AR, PSD/SD/AR ratios, bandwidth floors, channel costs.

    python benchmarks/step_bench.py --target-device cuda:0 --draft-device cuda:0 --out out/gpu

Models are built from production-shaped configs with random bf16 weights (Llama-3-8B target; Llama-3.2-1B- and
Llama-68M-shaped drafts) unless --target/--draft give real checkpoints. With random weights drafts are never
accepted, so throughput is measured with the benchmark-only --synthetic-acceptance P (not lossless, labelled in
every table). `--in-process-psd` also runs PSD here, Verify(X) and Propose(Y) each from its own thread and stream;
PSD through the real services is `benchmarks/services_bench.py`. `benchmarks/gpu_run.sh` holds the command lines a
GPU session runs (`check`, `compile`).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import GenerationMixin, PreTrainedModel

sys.path.insert(0, ".")
from benchmarks.gpu_common import Pair, base_parser, begin, kv_bytes, param_bytes, save, timed  # noqa: E402
from benchmarks.gpu_plots import plot_throughput, plot_timelines  # noqa: E402
from benchmarks.shaped_checkpoint import VOCAB, build  # noqa: E402
from draft_service.proposer import Proposer  # noqa: E402
from minedraft.engine.model_runner import ModelRunner  # noqa: E402
from minedraft.engine.models import load_model  # noqa: E402
from minedraft.engine.sampling import SamplingConfig  # noqa: E402
from target_service.verifier import Verifier  # noqa: E402


@dataclass
class Row:
    draft: str
    compiled: bool
    batch: int
    k: int
    t_draft_ms: float
    t_verify_ms: float
    t_ar_ms: float
    t_psd_step_ms: float
    mean_accepted: float
    ideal: float
    psd_over_sd: float
    sd_over_ar: float
    overlap_efficiency: float
    verify_floor_ms: float
    draft_floor_ms: float


def measure(
    name: str,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    batch: int,
    k: int,
    args: argparse.Namespace,
    bandwidth: float,
    timeline: list[dict] | None,
    compiled: bool,
) -> Row:
    devices = [args.target_device, args.draft_device]
    steps = args.steps
    pair = Pair(target, draft, batch, k, args.prefix, args.synthetic_acceptance, steps, not args.eager, compiled)
    for _ in range(2):  # warm-up, and the batches' first proposals
        pair.propose(0)
        pair.verify(0)
        pair.propose(1)
        pair.verify(1)
    t_d, t_v, t_ar = [], [], []
    for _ in range(steps):
        t_d.append(timed(lambda: pair.propose(0), devices))
        pair.settle()  # untimed: the draft service runs it after its reply, while the target verifies
        t_v.append(timed(lambda: pair.verify(0), devices))
        t_ar.append(timed(lambda: pair.verify(1, k=0), devices))
    pair.propose(0)
    torch.cuda.synchronize(args.draft_device)
    psd, origin = [], time.perf_counter()
    x = 0
    for _ in range(steps if args.in_process_psd else 0):
        step, v0, v1, p0, p1 = pair.psd_step(x)
        psd.append(step)
        if timeline is not None:
            timeline.append({"kind": "verify", "batch": x, "start": v0 - origin, "end": v1 - origin})
            timeline.append({"kind": "propose", "batch": 1 - x, "start": p0 - origin, "end": p1 - origin})
        x = 1 - x
    if not args.eager and (pair.verifier.runner.graphs is None or pair.proposer.runner.graphs is None):
        raise RuntimeError("a CUDA graph capture failed (see the log): these steps ran eagerly, not measured")
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    d, v, ar = med(t_d), med(t_v), med(t_ar)
    p = med(psd) if psd else float("nan")
    acc = sum(pair.accepted) / len(pair.accepted)
    tokens = batch * (acc + 1)
    sd_tput, psd_tput, ar_tput = tokens / (d + v), tokens / p, batch / ar
    length = args.prefix + steps * (k + 1)
    runner_t, runner_d = pair.verifier.runner, pair.proposer.runner
    verify_floor = (param_bytes(target) + kv_bytes(runner_t, batch, length)) / bandwidth
    draft_floor = k * (param_bytes(draft) + kv_bytes(runner_d, batch, length)) / bandwidth
    return Row(
        draft=name,
        compiled=compiled,
        batch=batch,
        k=k,
        t_draft_ms=d * 1e3,
        t_verify_ms=v * 1e3,
        t_ar_ms=ar * 1e3,
        t_psd_step_ms=p * 1e3,
        mean_accepted=acc,
        ideal=(d + v) / max(d, v),
        psd_over_sd=psd_tput / sd_tput,
        sd_over_ar=sd_tput / ar_tput,
        overlap_efficiency=max(d, v) / p,
        verify_floor_ms=verify_floor * 1e3,
        draft_floor_ms=draft_floor * 1e3,
    )


def channel_costs(device: str, out: dict) -> None:
    """Transfer time of ids and q at B=32, k=4, V=128k through the grpc-bytes channel (in process)."""
    from minedraft.channels.grpc_bytes import GrpcBytesChannel

    ids = torch.randint(0, VOCAB, (32, 4), device=device)
    probs = torch.rand(32, 4, VOCAB, device=device)
    channel = GrpcBytesChannel(torch.device(device))
    for name, p in (("ids", None), ("ids+probs", probs)):
        # The default binds this iteration's p; mypy infers no type for such a lambda against Callable[[], object]
        # without the cast.
        times = [
            timed(cast(Callable[[], object], lambda p=p: channel.receive(channel.send(0, ids, p))), [device])
            for _ in range(5)
        ]
        out[f"grpc_{name}_ms"] = sorted(times)[2] * 1e3


def _ipc_draft_side(conn: object, device: str) -> None:
    from minedraft.channels.cuda_ipc import CudaIpcChannel

    channel = CudaIpcChannel(torch.device(device))
    conn.send(channel.export(4, 32, VOCAB))  # type: ignore[attr-defined]
    generator = torch.Generator(device=device).manual_seed(3)
    while (step := conn.recv()) is not None:  # type: ignore[attr-defined]
        ids = torch.randint(0, VOCAB, (32, 4), device=device, generator=generator)
        probs = torch.rand(32, 4, VOCAB, device=device, generator=generator) if step % 2 else None
        payload = channel.send(step, ids, probs)
        torch.cuda.synchronize(device)
        conn.send((payload.SerializeToString(), ids.cpu(), None if probs is None else probs.sum().item()))  # type: ignore[attr-defined]


def cuda_ipc_costs(target_device: str, draft_device: str, out: dict) -> None:
    """Receive time of ids and of ids+q at B=32, k=4, V=128k over cuda-ipc from a real second process; also checks
    that what arrives is what was sent."""
    import torch.multiprocessing as mp

    from minedraft.channels.cuda_ipc import CudaIpcChannel
    from minedraft.proto import common_pb2

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ipc_draft_side, args=(child, draft_device))
    proc.start()
    channel = CudaIpcChannel(torch.device(target_device))
    channel.attach(parent.recv())
    times: dict[str, list[float]] = {"ids": [], "ids+probs": []}
    ok = True
    for step in range(12):
        parent.send(step)
        raw, ids_cpu, probs_sum = parent.recv()
        payload = common_pb2.DraftPayload.FromString(raw)
        holder: list = []
        # As in channel_costs: mypy infers no type for this lambda with defaults without the cast.
        elapsed = timed(
            cast(Callable[[], object], lambda h=holder, p=payload: h.append(channel.receive(p))), [target_device]
        )
        ids, probs = holder[0]
        ok &= bool((ids.cpu() == ids_cpu).all())
        if probs_sum is not None:
            ok &= abs(probs.sum().item() - probs_sum) <= 1e-3 * abs(probs_sum)
        if step >= 2:
            times["ids+probs" if probs_sum is not None else "ids"].append(elapsed)
    parent.send(None)
    proc.join()
    out["cuda_ipc_ids_ms"] = sorted(times["ids"])[len(times["ids"]) // 2] * 1e3
    out["cuda_ipc_ids_probs_ms"] = sorted(times["ids+probs"])[len(times["ids+probs"]) // 2] * 1e3
    out["cuda_ipc_transfer_exact"] = ok


def graphs_match_eager(model: PreTrainedModel, device: str, out: dict, compiled: bool) -> None:
    """CUDA-graph replays give exactly the eager outputs (same padded shapes, same kernels).

    With compiled layers, also how far they are from the uncompiled model (fused kernels round bf16 differently):
    max abs logit difference and the share of positions with the same argmax.
    """

    def outputs(runner: ModelRunner) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(4)
        rows = torch.arange(3, device=device)
        prompts = torch.randint(0, VOCAB, (3, 100), generator=generator).to(device)
        runner.allocate(3)
        collected = [runner.forward(rows, prompts, torch.full((3,), 100, device=device), last_only=True)]
        for n in (1, 5, 1, 2, 5):
            ids = torch.randint(0, VOCAB, (3, n), generator=generator).to(device)
            collected.append(runner.forward(rows, ids, torch.full((3,), n, device=device)).clone())
        return collected

    eager, graphs = (outputs(ModelRunner(model, 8, 1024, flag, compiled)) for flag in (False, True))
    suffix = "_compiled" if compiled else ""
    out["cuda_graphs_identical_to_eager" + suffix] = all(torch.equal(a, b) for a, b in zip(eager, graphs))
    out["cuda_graphs_max_abs_diff" + suffix] = max(float((a - b).abs().max()) for a, b in zip(eager, graphs))
    if compiled:
        with torch.compiler.set_stance("force_eager"):  # the same model, its layers uncompiled
            plain = outputs(ModelRunner(model, 8, 1024, cuda_graphs=False))
        out["compiled_vs_uncompiled_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(plain, graphs))
        same = [(a.argmax(-1) == b.argmax(-1)).float().mean() for a, b in zip(plain, graphs)]
        out["compiled_vs_uncompiled_same_argmax"] = float(torch.stack(same).mean())


def hf_assisted(
    target: PreTrainedModel, draft: PreTrainedModel, args: argparse.Namespace, out: dict, compiled: bool
) -> None:
    """Tokens/s at batch 1: Hugging Face assisted generation against our SD loop, same models, real acceptance."""
    from minedraft_app.offline import OfflineRequest, generate_offline

    prompt = torch.randint(0, VOCAB, (1, args.prefix), generator=torch.Generator().manual_seed(2))
    new = 64
    target.generation_config.pad_token_id = 0
    # Assisted generation wants both models on one device: a copy of the draft joins the target's.
    assistant = draft if args.draft_device == args.target_device else copy.deepcopy(draft).to(args.target_device)
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, assistant_model=assistant)
    # A causal LM's generate() comes from GenerationMixin, which the PreTrainedModel type lacks.
    hf_target = cast(GenerationMixin, target)
    with torch.compiler.set_stance("force_eager"):  # transformers as it comes, even once our runs compiled layers
        hf_target.generate(prompt.to(args.target_device), **kwargs)  # warm-up
        hf_s = timed(lambda: hf_target.generate(prompt.to(args.target_device), **kwargs), [args.target_device])
    verifier = Verifier(ModelRunner(target, 2, args.prefix + new + 16, not args.eager, compiled), [])
    proposer = Proposer(ModelRunner(draft, 2, args.prefix + new + 16, not args.eager, compiled))
    request = OfflineRequest(prompt[0].tolist(), SamplingConfig(max_tokens=new, ignore_eos=True))
    generate_offline(verifier, proposer, [request], 4, 1)
    ours_s = timed(lambda: generate_offline(verifier, proposer, [request], 4, 1), [args.target_device])
    out["hf_assisted_tokens_per_s"] = new / hf_s
    out["ours_sd_b1_tokens_per_s" + ("_compiled" if compiled else "")] = new / ours_s


def print_rows(rows: list[Row]) -> None:
    """The rows as a table, then PSD at B against SD at 2B (the same total concurrency) where both were run."""
    header = ("draft", "compiled", "B", "k", "T_d ms", "T_v ms", "floor_v", "T_psd", "acc", "ideal", "PSD/SD")
    print(" | ".join((*header, "ovl_eff", "SD/AR")))
    for r in rows:
        times = (r.t_draft_ms, r.t_verify_ms, r.verify_floor_ms, r.t_psd_step_ms)
        ratios = (r.mean_accepted, r.ideal, r.psd_over_sd, r.overlap_efficiency, r.sd_over_ar)
        cells = (r.draft, r.compiled, r.batch, r.k, *(f"{t:.1f}" for t in times), *(f"{x:.2f}" for x in ratios))
        print(" | ".join(str(x) for x in cells))
    by_key = {(r.draft, r.compiled, r.batch, r.k): r for r in rows}
    for r in rows:
        twice = by_key.get((r.draft, r.compiled, 2 * r.batch, r.k))
        if twice is not None:
            psd_tput = r.batch * (r.mean_accepted + 1) / r.t_psd_step_ms
            sd_tput = twice.batch * (twice.mean_accepted + 1) / (twice.t_draft_ms + twice.t_verify_ms)
            print(
                f"same concurrency {2 * r.batch}: {r.draft} k={r.k} PSD(2x{r.batch}) / SD(1x{2 * r.batch}) = "
                f"{psd_tput / sd_tput:.2f}"
            )


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument("--drafts", default="1b,68m", help="draft shapes when no --draft is given")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eager", action="store_true", help="run without CUDA graphs")
    parser.add_argument(
        "--in-process-psd",
        action="store_true",
        help="also time PSD in this process (two threads, two streams); it hung with CUDA graphs, "
        "so PSD is timed through the real services by default (services_bench.py)",
    )
    parser.add_argument(
        "--psd-watchdog",
        type=int,
        default=90,
        help="seconds one configuration may take before the run dumps every thread and exits",
    )
    args = parser.parse_args()
    summary, bandwidth = begin(args, args.eager)
    target = (
        load_model(args.target, args.target_device) if args.target else build(args.target_shape, args.target_device)
    )
    drafts = (
        {Path(d).name: load_model(d, args.draft_device) for d in args.draft}
        if args.draft
        else {s: build(s, args.draft_device) for s in args.drafts.split(",")}
    )
    rows: list[Row] = []
    timeline: list[dict] = []
    channel_costs(args.target_device, summary)
    cuda_ipc_costs(args.target_device, args.draft_device, summary)
    batch_sizes, ks = [int(b) for b in args.batch_sizes.split(",")], [int(k) for k in args.ks.split(",")]
    for compiled in [m == "on" for m in ("off", "on") if m in args.compile_modes.split(",")]:
        graphs_match_eager(next(iter(drafts.values())), args.draft_device, summary, compiled)
        print(json.dumps(summary), flush=True)
        configs = [(n, b, k) for n in drafts for b in batch_sizes for k in ks]
        for i, (name, batch, k) in enumerate(configs):
            want_timeline = not timeline and batch >= 8 and k == 4
            mode = "on" if compiled else "off"
            print(f"[{i + 1}/{len(configs)}] compile {mode}: measuring draft {name}, B={batch}, k={k}", flush=True)
            # A one-process PSD run once hung with CUDA graphs (both threads waiting in a device-to-host copy): a
            # hang then shows every thread and ends the run, keeping the rows written so far. Compiling takes long.
            faulthandler.dump_traceback_later(args.psd_watchdog + (300 if compiled else 0), exit=True)
            row = measure(
                name, target, drafts[name], batch, k, args, bandwidth, timeline if want_timeline else None, compiled
            )
            faulthandler.cancel_dump_traceback_later()
            rows.append(row)
            shown = {key: round(v, 3) if isinstance(v, float) else v for key, v in asdict(row).items()}
            print(f"[{i + 1}/{len(configs)}] {json.dumps(shown)}", flush=True)
            save(args, summary, [asdict(r) for r in rows], timeline)
            torch.cuda.empty_cache()
        hf_assisted(target, next(iter(drafts.values())), args, summary, compiled)
        print(json.dumps({k: v for k, v in summary.items() if k.startswith(("hf_", "ours_"))}), flush=True)
        save(args, summary, [asdict(r) for r in rows], timeline)
    if timeline:
        plot_timelines({"one process": timeline}, Path(args.out))
    if rows:
        plot_throughput(rows, Path(args.out))
    save(args, summary, [asdict(r) for r in rows], timeline)
    print(f"\nsynthetic acceptance {args.synthetic_acceptance} (benchmark only); {summary['gpu']}")
    print_rows(rows)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
