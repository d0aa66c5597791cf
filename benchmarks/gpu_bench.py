"""The whole GPU check in one run: step times, PSD/SD/AR ratios, channel cost, bandwidth floors, plots.

    python benchmarks/gpu_bench.py --target-device cuda:0 --draft-device cuda:0 --out out/gpu

Models are built from production-shaped configs with random bf16 weights (Llama-3-8B target; Llama-3.2-1B- and
Llama-68M-shaped drafts) unless --target/--draft give real checkpoints. With random weights drafts are never
accepted, so throughput is measured with the benchmark-only --synthetic-acceptance P (not lossless, labelled in
every table). Step times (T_d, T_v, AR) are measured in this process; PSD against SD and AR is measured through the
real services (`--services`): on one GPU as separate processes sharing it, with and without CUDA MPS; on two GPUs
(`--draft-device cuda:1`) once per channel (`--services-channels cuda-ipc,nccl`), plus SD with the draft on the
target's GPU. `--in-process-psd` also runs PSD here, Verify(X) and Propose(Y) each from its own thread and stream.
`benchmarks/gpu_run.sh` holds the command lines a GPU session runs.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.models import load_model
from minedraft.engine.sampling import SamplingConfig
from minedraft_app.flags import PRECAPTURE_CHOICES
from target_service.verifier import Verifier

sys.path.insert(0, ".")
from benchmarks.shaped_checkpoint import SHAPES, VOCAB, shaped_checkpoint, shaped_config  # noqa: E402

EAGER = False  # --eager: no CUDA graphs
COMPILE = False  # the mode of --compile-modes being measured: torch.compile'd decoder layers


def build(shape: str, device: str) -> PreTrainedModel:
    """A `shape`-shaped model (`SHAPES`) with random bf16 weights, in memory on `device`."""
    config = shaped_config(shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def hbm_bandwidth(device: str) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.randn(1 << 28, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * src.numel() * 4 * 10 / (time.perf_counter() - start)


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes(runner: ModelRunner, rows: int, length: int) -> int:
    # The cache is [rows, kv_heads, max_len, head_dim] per layer.
    return sum(2 * rows * length * k.shape[1] * k.shape[3] * k.element_size() for k in runner.cache.keys)


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


def timed(fn: Callable[[], object], devices: list[str]) -> float:
    for d in set(devices):
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    fn()
    for d in set(devices):
        torch.cuda.synchronize(d)
    return time.perf_counter() - start


class Pair:
    """Verifier and proposer over two batches, driven step by step like the coordinator would."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        batch: int,
        k: int,
        prefix: int,
        synthetic: float | None,
        steps: int,
    ) -> None:
        # A cache as long as the services' default (--max-model-len 2048): reading a row's first kv_len keys out of a
        # longer row is what a served step does (a cache just long enough read whole rows, faster).
        max_len = max(2048, prefix + (steps + 4) * (k + 1) * 3 + 16)
        graphs = not EAGER
        self.verifier = Verifier(
            ModelRunner(target, 2 * batch, max_len, graphs, COMPILE), [], synthetic_acceptance=synthetic
        )
        self.verifier.warm_up(k)
        self.proposer = Proposer(ModelRunner(draft, 2 * batch, max_len, graphs, COMPILE))
        self.k, self.batch = k, batch
        # As the draft service: a proposal's upkeep (its keep-ahead) left for after its reply, run by `settle` or
        # the next proposal; False runs it inside the proposal.
        self.defer_upkeep = True
        self.upkeep: Callable[[], None] | None = None
        self.t_stream = torch.cuda.Stream(self.verifier.runner.device)
        self.d_stream = torch.cuda.Stream(self.proposer.runner.device)
        generator = torch.Generator().manual_seed(1)
        self.ids = [list(range(b * batch, (b + 1) * batch)) for b in range(2)]
        self.verdict: dict[int, tuple[int, int]] = {}
        self.drafts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.accepted: list[float] = []
        self.ready: dict[int, torch.cuda.Event] = {}
        for seqs in self.ids:
            prompts = torch.randint(0, VOCAB, (batch, prefix), generator=generator).tolist()
            # A seed per row, as the coordinator gives unseeded requests: synthetic acceptance draws per row then,
            # not one shared draw for the whole batch.
            configs = [SamplingConfig(max_tokens=10**6, ignore_eos=True, seed=s + 1) for s in seqs]
            first = self.verifier.prefill(seqs, prompts, configs).per_row()
            self.proposer.prefill(seqs, prompts, configs)
            self.verdict.update({s: (0, tokens[-1]) for s, (tokens, _, _) in zip(seqs, first)})

    def propose(self, b: int) -> None:
        self.settle()
        with torch.cuda.stream(self.d_stream):
            seqs = self.ids[b]
            accepted = torch.tensor([self.verdict[s][0] for s in seqs])
            last = torch.tensor([self.verdict[s][1] for s in seqs])
            proposal = self.proposer.propose(seqs, accepted, last, self.k, b, defer_upkeep=self.defer_upkeep)
            self.upkeep = proposal.upkeep
            self.drafts[b] = (proposal.draft_ids, proposal.draft_probs)
            self.ready[b] = torch.cuda.Event()
            self.ready[b].record()

    def settle(self) -> None:
        """Run the upkeep the last proposal left (`defer_upkeep`), as the draft service does after its reply."""
        if self.upkeep is not None:
            with torch.cuda.stream(self.d_stream):
                self.upkeep()
            self.upkeep = None

    def verify(self, b: int, k: int | None = None) -> None:
        with torch.cuda.stream(self.t_stream):
            seqs = self.ids[b]
            if k == 0:
                drafts, probs = torch.zeros(len(seqs), 0, dtype=torch.long), None
            else:
                torch.cuda.current_stream().wait_event(self.ready[b])
                drafts, probs = self.drafts.pop(b)
            result = self.verifier.verify(seqs, drafts, probs, b)
            rows = result.per_row()
            self.verdict.update({s: (a, tokens[-1]) for s, (tokens, a, _) in zip(seqs, rows)})
            if k != 0:
                self.accepted.append(sum(a for _, a, _ in rows) / len(rows))

    def psd_step(self, x: int) -> tuple[float, float, float, float, float]:
        """Verify(x) and Propose(1-x) at once, each from its own thread; returns (step, start/end offsets)."""
        spans: dict[str, tuple[float, float]] = {}

        def run(name: str, fn: Callable[[], None], device: torch.device) -> None:
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            spans[name] = (start, time.perf_counter())

        threads = [
            threading.Thread(target=run, args=("verify", lambda: self.verify(x), self.verifier.runner.device)),
            threading.Thread(target=run, args=("propose", lambda: self.propose(1 - x), self.proposer.runner.device)),
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = time.perf_counter()
        return end - start, *spans["verify"], *spans["propose"]


def measure(
    name: str,
    target: PreTrainedModel,
    draft: PreTrainedModel,
    batch: int,
    k: int,
    args: argparse.Namespace,
    bandwidth: float,
    timeline: list[dict] | None,
) -> Row:
    devices = [args.target_device, args.draft_device]
    steps = args.steps
    pair = Pair(target, draft, batch, k, args.prefix, args.synthetic_acceptance, steps)
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
    if not EAGER and (pair.verifier.runner.graphs is None or pair.proposer.runner.graphs is None):
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
        compiled=COMPILE,
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


def graphs_match_eager(model: PreTrainedModel, device: str, out: dict) -> None:
    """CUDA-graph replays give exactly the eager outputs (same padded shapes, same kernels).

    With compiled layers (COMPILE), also how far they are from the uncompiled model (fused kernels round bf16
    differently): max abs logit difference and the share of positions with the same argmax.
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

    eager, graphs = (outputs(ModelRunner(model, 8, 1024, flag, COMPILE)) for flag in (False, True))
    suffix = "_compiled" if COMPILE else ""
    out["cuda_graphs_identical_to_eager" + suffix] = all(torch.equal(a, b) for a, b in zip(eager, graphs))
    out["cuda_graphs_max_abs_diff" + suffix] = max(float((a - b).abs().max()) for a, b in zip(eager, graphs))
    if COMPILE:
        with torch.compiler.set_stance("force_eager"):  # the same model, its layers uncompiled
            plain = outputs(ModelRunner(model, 8, 1024, cuda_graphs=False))
        out["compiled_vs_uncompiled_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(plain, graphs))
        same = [(a.argmax(-1) == b.argmax(-1)).float().mean() for a, b in zip(plain, graphs)]
        out["compiled_vs_uncompiled_same_argmax"] = float(torch.stack(same).mean())


def hf_assisted(target: PreTrainedModel, draft: PreTrainedModel, args: argparse.Namespace, out: dict) -> None:
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
    verifier = Verifier(ModelRunner(target, 2, args.prefix + new + 16, not EAGER, COMPILE), [])
    proposer = Proposer(ModelRunner(draft, 2, args.prefix + new + 16, not EAGER, COMPILE))
    request = OfflineRequest(prompt[0].tolist(), SamplingConfig(max_tokens=new, ignore_eos=True))
    generate_offline(verifier, proposer, [request], 4, 1)
    ours_s = timed(lambda: generate_offline(verifier, proposer, [request], 4, 1), [args.target_device])
    out["hf_assisted_tokens_per_s"] = new / hf_s
    out["ours_sd_b1_tokens_per_s" + ("_compiled" if COMPILE else "")] = new / ours_s


def trace_stats(events: list[dict]) -> dict:
    """From a coordinator step trace (any mode), full-batch calls: median call and compute times, channel share,
    overlap, and the gap between one call's end and the next call's start (coordinator time between calls)."""
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    full = max((e["batch_size"] for e in events if e["kind"] == "verify"), default=0)
    verify = [e for e in events if e["kind"] == "verify" and e["batch_size"] == full]
    propose = [e for e in events if e["kind"] == "propose" and e["batch_size"] == full]
    overlapped = sum(max(0.0, min(v["end"], p["end"]) - max(v["start"], p["start"])) for v in verify for p in propose)
    busy = sum(v["end"] - v["start"] for v in verify)
    ordered = sorted(verify + propose, key=lambda e: e["start"])
    starts = sorted(v["start"] for v in verify)
    return {
        # One step of one batch's worth of tokens: psd alternates batches, so consecutive verifies are its steps.
        "step_ms": med([b - a for a, b in zip(starts, starts[1:])]) * 1e3,
        "gap_between_calls_ms": med([b["start"] - a["end"] for a, b in zip(ordered, ordered[1:])]) * 1e3,
        "batch_size": full,
        "propose_ms": med([e["end"] - e["start"] for e in propose]) * 1e3,
        "verify_ms": med([e["end"] - e["start"] for e in verify]) * 1e3,
        "verify_compute_ms": med([e["worker_compute_s"] for e in verify]) * 1e3,
        "propose_compute_ms": med([e["worker_compute_s"] for e in propose]) * 1e3,
        # Waiting in the worker for its compute thread (absent from older traces)
        "verify_queue_ms": med([e.get("worker_queue_s", float("nan")) for e in verify]) * 1e3,
        "propose_queue_ms": med([e.get("worker_queue_s", float("nan")) for e in propose]) * 1e3,
        # The worker's handler, arrival to reply (absent from older traces): the rest of a call is gRPC and event loops
        "verify_worker_ms": med([e.get("worker_s", float("nan")) for e in verify]) * 1e3,
        "propose_worker_ms": med([e.get("worker_s", float("nan")) for e in propose]) * 1e3,
        "channel_share_of_verify": med(
            [e["channel_s"] / e["worker_compute_s"] for e in verify if e["worker_compute_s"]]
        ),
        "verify_time_overlapped_by_propose": overlapped / busy if busy else float("nan"),
    }


@dataclass
class ServicesRun:
    """One `minedraft bench` run of the services comparison."""

    label: str
    draft: str
    modes: str
    draft_device: str
    channel: str = "auto"
    mps: bool = False


def services_plan(runs: list[str], args: argparse.Namespace, mps_available: bool) -> list[ServicesRun]:
    """On one GPU each draft shape time-sliced and under MPS (or as `SHAPE:timesliced` / `SHAPE:mps`); on two GPUs
    PSD, SD and AR once per channel, SD with the draft on the target's GPU (the paper's baseline), and SD on two
    independent stacks, one per GPU (`sddp`: data parallel, what a user with two GPUs would otherwise run; not with
    tensor parallelism)."""
    suffix = "_compiled" if COMPILE else ""
    channels = args.services_channels.split(",")
    plan = []
    for run in runs:
        name, _, sharing = run.partition(":")
        if args.target_device != args.draft_device:
            for i, channel in enumerate(channels):  # AR does not use the channel: measured once
                plan.append(
                    ServicesRun(
                        f"{name}_2gpu_{channel}{suffix}",
                        name,
                        args.services_modes if i == 0 else "psd,sd",
                        args.draft_device,
                        channel,
                    )
                )
            if not args.services_no_sd_on_target:
                plan.append(ServicesRun(f"{name}_sd_draft_on_target_gpu{suffix}", name, "sd", args.target_device))
            if max(args.tensor_parallel_size, args.draft_tensor_parallel_size) == 1 and not args.services_no_sd_dp:
                plan.append(ServicesRun(f"{name}_sd_data_parallel{suffix}", name, "sddp", args.draft_device))
            continue
        for way in [sharing] if sharing else ["timesliced", "mps"]:
            if way == "mps" and not mps_available:
                continue
            for channel in channels:
                label = f"{name}_{way}" + (f"_{channel}" if channel != "auto" else "") + suffix
                plan.append(ServicesRun(label, name, args.services_modes, args.draft_device, channel, way == "mps"))
    return plan


def steady_state(psd: dict, sd: dict) -> dict:
    """PSD against SD from their step traces (`trace_stats`), full batches only: the whole-load throughput also
    counts admission, graph captures and the tail of small batches. At one batch size a step emits the same tokens
    in both modes, so the step times give the ratio; the ideal comes from SD's calls (T_d, T_v). Since a proposal
    replies once its graph is launched, on the cuda-ipc and nccl channels SD's propose call holds the
    draft's host time only and its verify call the rest of the draft's GPU time: there the ideal is not T_d/T_v's
    (use the in-process step times)."""
    t_d, t_v = sd["propose_ms"], sd["verify_ms"]
    ideal = (t_d + t_v) / max(t_d, t_v)
    ratio = sd["step_ms"] / psd["step_ms"]
    return {
        "t_d_ms": t_d,
        "t_v_ms": t_v,
        "ideal": ideal,
        "psd_step_ms": psd["step_ms"],
        "sd_step_ms": sd["step_ms"],
        "psd_over_sd": ratio,
        "share_of_ideal": ratio / ideal,
        "overlap_efficiency": max(t_d, t_v) / psd["step_ms"],
        "channel_share_of_verify": psd["channel_share_of_verify"],
        "verify_overlapped_by_propose": psd["verify_time_overlapped_by_propose"],
    }


def two_gpu_summary(results: dict[str, dict], name: str, channel: str) -> dict:
    """PSD on two GPUs over the whole load against SD with the draft on the target's GPU and on its own, SD at the
    same total concurrency (`sd2b`: one batch of 2B), SD on two independent stacks (`sddp`) and AR; and the steady
    state."""
    suffix = "_compiled" if COMPILE else ""
    label = f"{name}_2gpu_{channel}{suffix}"
    own, same = results.get(label), results.get(f"{name}_sd_draft_on_target_gpu{suffix}")
    ar_run = next(
        (r for key, r in results.items() if key.startswith(f"{name}_2gpu_") and "ar" in r.get("results", {})), None
    )
    if own is None or "psd" not in own["results"]:
        return {}
    tput = lambda run, mode: run["results"][mode]["output_throughput"] if run and mode in run["results"] else None  # noqa: E731
    psd, sd_own, sd_same, ar = tput(own, "psd"), tput(own, "sd"), tput(same, "sd"), tput(ar_run, "ar")
    sd_2b, sd_dp = tput(own, "sd2b"), tput(results.get(f"{name}_sd_data_parallel{suffix}"), "sddp")
    out: dict = {
        "psd_tok_s": psd,
        "sd_draft_own_gpu_tok_s": sd_own,
        "sd_draft_on_target_gpu_tok_s": sd_same,
        "sd_same_concurrency_tok_s": sd_2b,
        "sd_data_parallel_tok_s": sd_dp,
        "ar_tok_s": ar,
        "steady": results.get(f"{label}_steady"),
    }
    for key, base in (
        ("psd_over_sd_draft_on_target_gpu", sd_same),
        ("psd_over_sd_draft_own_gpu", sd_own),
        ("psd_over_sd_same_concurrency", sd_2b),
        ("psd_over_sd_data_parallel", sd_dp),
        ("psd_over_ar", ar),
    ):
        out[key] = psd / base if psd and base else None
    psd_trace = results.get(f"{label}_psd_trace")
    same_trace = results.get(f"{name}_sd_draft_on_target_gpu{suffix}_sd_trace")
    if psd_trace and same_trace:  # the paper's baseline, in steady state
        out["steady_psd_over_sd_draft_on_target_gpu"] = same_trace["step_ms"] / psd_trace["step_ms"]
    trace_2b = results.get(f"{label}_sd2b_trace")
    if psd_trace and trace_2b:  # per sequence-step: PSD's step advances one batch of B, sd2b's one of 2B
        out["steady_psd_over_sd_same_concurrency"] = (psd_trace["batch_size"] / psd_trace["step_ms"]) / (
            trace_2b["batch_size"] / trace_2b["step_ms"]
        )
    return out


def services_comparison(runs: list[str], args: argparse.Namespace, summary: dict, save: Callable[[], None]) -> None:
    """PSD, SD and AR through the real services (separate processes): `minedraft bench --modes ...` as
    `services_plan` lays out (`runs` are draft shapes or --draft directories' names, on one GPU optionally
    `SHAPE:timesliced` or `SHAPE:mps`), on the --target and --draft checkpoints, else on shaped ones with random
    weights written for the run (`shaped_checkpoint`: prompts come from the demo tokenizer, whose ids are valid in
    the 128k vocabulary)."""
    mps = shutil.which("nvidia-cuda-mps-control")
    plan = services_plan(runs, args, mps is not None)
    root = Path(tempfile.mkdtemp(prefix="minedraft-services-"))
    # Kept for later calls on the same machine: a 70B-shaped target takes minutes to write.
    kept = Path(args.checkpoint_dir)
    target_dir = args.target or shaped_checkpoint(args.target_shape, kept / args.target_shape, args.target_device)
    given = {Path(d).name: d for d in args.draft or []}
    draft_dirs = {
        name: given.get(name) or shaped_checkpoint(name, kept / name, args.draft_device)
        for name in sorted({r.draft for r in plan})
    }
    results: dict[str, dict] = summary.setdefault("services", {})
    summary["services_tensor_parallel_size"] = args.tensor_parallel_size
    summary["services_draft_tensor_parallel_size"] = args.draft_tensor_parallel_size
    timelines: dict[str, list[dict]] = summary.setdefault("services_timelines", {})
    for i, run in enumerate(plan):
        label = run.label
        env = dict(os.environ)
        if args.services_profile:  # every worker of these stacks traces five calls after its first 100
            env["MINEDRAFT_PROFILE_DIR"] = str(root / f"profiles_{label}")
        if run.mps:
            assert mps is not None
            pipe = tempfile.mkdtemp(prefix="mps-")
            env.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=pipe)
            subprocess.run([mps, "-d"], env=env, check=True)  # a user-level daemon: no GPU setting changes
        json_out = root / f"services_{label}.json"
        traces = root / f"traces_{label}"
        command = [
            sys.executable,
            "-m",
            "minedraft_app",
            "bench",
            "--modes",
            run.modes,
            "--target",
            str(target_dir),
            "--draft",
            str(draft_dirs[run.draft]),
            "--target-device",
            args.target_device,
            "--draft-device",
            run.draft_device,
            "--channel",
            run.channel,
            "--dtype",
            "bfloat16",
            "--num-speculative-tokens",
            "4",
            "--max-batch-size",
            str(args.services_batch),
            "--overlap",
            args.services_overlap,
            "--speculation",
            args.services_speculation,
            "--min-speculative-tokens",
            str(args.services_min_speculative_tokens),
            "--synthetic-acceptance",
            str(args.synthetic_acceptance),
            "--num-prompts",
            str(args.services_prompts or 2 * args.services_batch),
            "--prompt-len",
            str(args.prefix),
            "--output-len",
            str(args.services_output_len),
            "--no-progress",
            "--json-out",
            str(json_out),
            "--step-trace-dir",
            str(traces),
            "--log-dir",
            str(root / f"logs_{label}"),
        ]
        command += ["--compile"] if COMPILE else []
        command += ["--concurrency", str(args.services_concurrency)] if args.services_concurrency else []
        command += ["--precapture-graphs", args.services_precapture]
        command += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
        command += ["--draft-tensor-parallel-size", str(args.draft_tensor_parallel_size)]
        print(f"[services {i + 1}/{len(plan)}] {label}: {' '.join(command)}", flush=True)
        bench = subprocess.Popen(command, env=env)
        try:
            bench.wait(timeout=args.services_timeout)
        except subprocess.TimeoutExpired:
            print(f"services, {label}: timed out after {args.services_timeout} s", flush=True)
            bench.send_signal(signal.SIGINT)  # it stops the services it started
            try:
                bench.wait(timeout=30)
            except subprocess.TimeoutExpired:
                bench.kill()
                # Its services (sessions of their own) would keep the GPU's memory: each names a checkpoint here.
                for model in {str(target_dir), str(draft_dirs[run.draft])}:
                    subprocess.run(["pkill", "-f", model], check=False)
        finally:
            if run.mps:
                subprocess.run([mps], input=b"quit\n", env=env, check=False)  # type: ignore[list-item]
        if (root / f"logs_{label}").exists():
            shutil.copytree(root / f"logs_{label}", Path(args.out) / f"logs_{label}", dirs_exist_ok=True)
        for log in sorted((root / f"logs_{label}").glob("*.log")):  # the services' own output, for diagnosis
            print(
                f"--- {log.name} (last lines) ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]),
                flush=True,
            )
        if json_out.exists():
            results[label] = json.loads(json_out.read_text())
        if args.services_profile and (root / f"profiles_{label}").exists():
            shutil.make_archive(str(Path(args.out) / f"profiles_{label}"), "gztar", root / f"profiles_{label}")
        print(f"services, {label}: {results.get(label, {}).get('ratios')}", flush=True)
        if traces.exists():
            shutil.copytree(traces, Path(args.out) / f"traces_{label}", dirs_exist_ok=True)
        for mode in run.modes.split(","):
            trace = traces / f"{mode}.jsonl"
            if not trace.exists():
                continue
            events = [json.loads(line) for line in trace.read_text().splitlines() if line]
            results[f"{label}_{mode}_trace"] = trace_stats(events)
            print(f"services, {label}, {mode} trace: {results[f'{label}_{mode}_trace']}", flush=True)
            calls = [e for e in events if e["kind"] in ("propose", "verify")]
            window = calls[len(calls) // 2 : len(calls) // 2 + 40]  # steady state, full batches
            if mode == "psd" and window:
                origin = window[0]["start"]
                timelines[label] = [
                    {"kind": e["kind"], "batch": e["batch_id"], "start": e["start"] - origin, "end": e["end"] - origin}
                    for e in window
                ]
        if f"{label}_psd_trace" in results and f"{label}_sd_trace" in results:
            results[f"{label}_steady"] = steady_state(results[f"{label}_psd_trace"], results[f"{label}_sd_trace"])
            print(f"services, {label}, steady state: {results[f'{label}_steady']}", flush=True)
        save()
    if args.target_device != args.draft_device:
        two = summary.setdefault("two_gpu", {})
        for name in sorted({r.draft for r in plan}):
            for channel in args.services_channels.split(","):
                two[f"{name}_{channel}" + ("_compiled" if COMPILE else "")] = two_gpu_summary(results, name, channel)
        print(f"two GPUs: {json.dumps(two, indent=1)}", flush=True)
        save()
    shutil.rmtree(root, ignore_errors=True)


def plot(rows: list[Row], timelines: dict[str, list[dict]], out_dir: Path) -> None:
    """timeline.png: draft and verify spans over time per run; throughput_vs_batch.png: tokens/s per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if timelines:
        fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 1.6 + 1.4 * len(timelines)), squeeze=False)
        for ax, (label, events) in zip(axes[:, 0], timelines.items()):
            for event in events:
                y = 1 if event["kind"] == "verify" else 0
                ax.barh(
                    y, event["end"] - event["start"], left=event["start"], color="C0" if event["batch"] == 0 else "C1"
                )
            ax.set_yticks([0, 1], ["draft: Propose", "target: Verify"])
            ax.set_title(f"PSD step timeline, {label}", fontsize=9)
        axes[-1, 0].set_xlabel("seconds (blue: batch 0, orange: batch 1)")
        fig.tight_layout()
        fig.savefig(out_dir / "timeline.png", dpi=120)
    if not rows:  # --services-only
        return

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (draft, compiled) in enumerate(sorted({(r.draft, r.compiled) for r in rows})):
        how = ", compiled" if compiled else ""
        for k in sorted({r.k for r in rows}):
            sel = [r for r in rows if (r.draft, r.compiled, r.k) == (draft, compiled, k)]
            sd = [r.batch * (r.mean_accepted + 1) / (r.t_draft_ms + r.t_verify_ms) * 1e3 for r in sel]
            ax.plot([r.batch for r in sel], sd, marker="o", color=f"C{i}", label=f"SD, {draft} draft{how}, k={k}")
            psd = [
                (r.batch, r.batch * (r.mean_accepted + 1) / r.t_psd_step_ms * 1e3)
                for r in sel
                if r.t_psd_step_ms == r.t_psd_step_ms
            ]
            if psd:
                ax.plot(*zip(*psd), marker="s", ls="--", color=f"C{i}", label=f"PSD (one process), {draft}{how}, k={k}")
    for compiled in sorted({r.compiled for r in rows}):
        ar = {r.batch: r.batch / r.t_ar_ms * 1e3 for r in rows if r.compiled == compiled}
        ax.plot(
            sorted(ar),
            [ar[b] for b in sorted(ar)],
            marker="^",
            color="grey",
            ls=":" if compiled else "-",
            label="AR (target alone)" + (", compiled" if compiled else ""),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens/s (synthetic acceptance)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "throughput_vs_batch.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-device", default="cuda:0")
    parser.add_argument("--draft-device", default="cuda:0")
    parser.add_argument("--target", help="real target checkpoint directory (default: random, --target-shape)")
    parser.add_argument("--target-shape", default="8b", choices=sorted(SHAPES), help="the random target's shape")
    parser.add_argument(
        "--checkpoint-dir",
        default="/tmp/minedraft-shaped-ckpt",
        help="where the services' random checkpoints are written once per shape, and found by later runs",
    )
    parser.add_argument("--draft", action="append", help="real draft checkpoint directories")
    parser.add_argument("--drafts", default="1b,68m", help="draft shapes when no --draft is given")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--synthetic-acceptance",
        type=float,
        default=0.7,
        help="BENCHMARK ONLY, not lossless: accept each draft with this probability",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "out/gpu"))
    parser.add_argument("--eager", action="store_true", help="run without CUDA graphs")
    parser.add_argument(
        "--compile-modes",
        default="off",
        help="off, on or off,on: without and/or with torch.compile'd decoder layers, side by side "
        "(compiling is in place, so off is measured first)",
    )
    parser.add_argument(
        "--services",
        default="",
        help="draft shapes to also run through the real services on one GPU, time-sliced and "
        "under MPS (e.g. 68m), or one way only (e.g. 68m,1b:mps)",
    )
    parser.add_argument(
        "--services-channels",
        default="auto",
        help="channels of the services runs, comma-separated (auto: cuda-ipc on one host)",
    )
    parser.add_argument("--services-modes", default="psd,sd,ar", help="modes of each services run")
    parser.add_argument("--services-output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument(
        "--services-no-sd-on-target",
        action="store_true",
        help="on two GPUs, skip SD with the draft on the target's GPU (the paper's baseline)",
    )
    parser.add_argument(
        "--services-no-sd-dp",
        action="store_true",
        help="on two GPUs, skip SD on two independent stacks, one per GPU (sddp, data parallel)",
    )
    parser.add_argument(
        "--services-precapture",
        default="auto",
        nargs="?",
        const="on",
        choices=PRECAPTURE_CHOICES,
        help="workers' --precapture-graphs: every step shape run when the coordinator connects",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="the target's --tensor-parallel-size in the services runs (its ranks on the GPUs from --target-device "
        "on; give a --draft-device past them); the step times measured in this process stay on one GPU",
    )
    parser.add_argument(
        "--draft-tensor-parallel-size",
        type=int,
        default=1,
        help="the draft's --tensor-parallel-size in the services runs (its ranks on the GPUs from --draft-device on)",
    )
    parser.add_argument("--services-only", action="store_true", help="skip everything but the --services runs")
    parser.add_argument("--services-batch", type=int, default=32, help="max batch size of the services run")
    parser.add_argument(
        "--services-prompts",
        type=int,
        default=None,
        help="requests per services run (default: two full batches; more gives steadier figures)",
    )
    parser.add_argument(
        "--services-concurrency",
        type=int,
        default=None,
        help="requests in flight per services run (default: two full batches; more keeps some waiting)",
    )
    parser.add_argument(
        "--services-overlap",
        default="always",
        choices=["always", "auto", "never"],
        help="the coordinator's --overlap in the services runs (always: measure the overlap itself; "
        "auto: what users get, sequential calls where overlapping does not pay)",
    )
    parser.add_argument(
        "--services-speculation",
        default="auto",
        choices=["auto", "always"],
        help="the coordinator's --speculation in the services runs (auto: what users get, the target "
        "alone where drafting does not pay; always: draft at every step)",
    )
    parser.add_argument(
        "--services-min-speculative-tokens",
        type=int,
        default=0,
        help="the coordinator's --min-speculative-tokens in the services runs (0: 4 tokens or none; 1: also 2 or 1)",
    )
    parser.add_argument(
        "--services-profile",
        action="store_true",
        help="the services write profiler traces of five calls each (profiles_<run>.tar.gz in --out)",
    )
    parser.add_argument(
        "--services-timeout",
        type=int,
        default=300,
        help="seconds per services comparison (three stacks started and stopped)",
    )
    parser.add_argument(
        "--in-process-psd",
        action="store_true",
        help="also time PSD in this process (two threads, two streams); it hung with CUDA graphs, "
        "so the default times PSD through the real services (--services)",
    )
    parser.add_argument(
        "--psd-watchdog",
        type=int,
        default=90,
        help="seconds one configuration may take before the run dumps every thread and exits",
    )
    args = parser.parse_args()
    # `timeout -s USR1` then shows where every thread is, should a run hang.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    global EAGER
    EAGER = args.eager
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "eager": args.eager,
        "synthetic_acceptance": args.synthetic_acceptance,
        "torch": torch.__version__,
    }
    bandwidth = hbm_bandwidth(args.target_device)
    summary["hbm_bandwidth_GBps"] = bandwidth / 1e9
    print(f"HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    # In memory only for the steps measured here: the services load checkpoints (a 70B-shaped one fits no GPU whole).
    in_process = not args.services_only
    target: PreTrainedModel | None = None
    drafts: dict[str, PreTrainedModel] = {}
    if in_process:
        device = args.target_device
        target = load_model(args.target, device) if args.target else build(args.target_shape, device)
        drafts = (
            {Path(d).name: load_model(d, args.draft_device) for d in args.draft}
            if args.draft
            else {s: build(s, args.draft_device) for s in args.drafts.split(",")}
        )
    rows: list[Row] = []
    timeline: list[dict] = []

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        (out_dir / "gpu_bench.json").write_text(
            json.dumps({"summary": summary, "rows": [asdict(r) for r in rows], "timeline": timeline}, indent=1)
        )

    if not args.services_only:
        channel_costs(args.target_device, summary)
        cuda_ipc_costs(args.target_device, args.draft_device, summary)
    batch_sizes, ks = [int(b) for b in args.batch_sizes.split(",")], [int(k) for k in args.ks.split(",")]
    modes = [m for m in ("off", "on") if m in args.compile_modes.split(",")]
    global COMPILE
    for mode in modes:
        COMPILE = mode == "on"
        if target is None:  # --services-only
            continue
        graphs_match_eager(next(iter(drafts.values())), args.draft_device, summary)
        print(json.dumps(summary), flush=True)
        configs = [(n, b, k) for n in drafts for b in batch_sizes for k in ks]
        for i, (name, batch, k) in enumerate(configs):
            want_timeline = not timeline and batch >= 8 and k == 4
            print(f"[{i + 1}/{len(configs)}] compile {mode}: measuring draft {name}, B={batch}, k={k}", flush=True)
            # A one-process PSD run once hung with CUDA graphs (both threads waiting in a device-to-host copy): a
            # hang then shows every thread and ends the run, keeping the rows written so far. Compiling takes long.
            faulthandler.dump_traceback_later(args.psd_watchdog + (300 if COMPILE else 0), exit=True)
            row = measure(name, target, drafts[name], batch, k, args, bandwidth, timeline if want_timeline else None)
            faulthandler.cancel_dump_traceback_later()
            rows.append(row)
            shown = {key: round(v, 3) if isinstance(v, float) else v for key, v in asdict(row).items()}
            print(f"[{i + 1}/{len(configs)}] {json.dumps(shown)}", flush=True)
            save()
            torch.cuda.empty_cache()
        hf_assisted(target, next(iter(drafts.values())), args, summary)
        print(json.dumps({k: v for k, v in summary.items() if k.startswith(("hf_", "ours_"))}), flush=True)
        save()
    if args.services:
        services_comparison(args.services.split(","), args, summary, save)
    plot(rows, {"one process": timeline} if timeline else summary.get("services_timelines", {}), out_dir)
    save()
    header = (
        "draft",
        "compiled",
        "B",
        "k",
        "T_d ms",
        "T_v ms",
        "floor_v",
        "T_psd",
        "acc",
        "ideal",
        "PSD/SD",
        "ovl_eff",
        "SD/AR",
    )
    print(f"\nsynthetic acceptance {args.synthetic_acceptance} (benchmark only); {summary['gpu']}")
    print(" | ".join(header))
    for r in rows:
        print(
            " | ".join(
                str(x)
                for x in (
                    r.draft,
                    r.compiled,
                    r.batch,
                    r.k,
                    f"{r.t_draft_ms:.1f}",
                    f"{r.t_verify_ms:.1f}",
                    f"{r.verify_floor_ms:.1f}",
                    f"{r.t_psd_step_ms:.1f}",
                    f"{r.mean_accepted:.2f}",
                    f"{r.ideal:.2f}",
                    f"{r.psd_over_sd:.2f}",
                    f"{r.overlap_efficiency:.2f}",
                    f"{r.sd_over_ar:.2f}",
                )
            )
        )
    # SD at the same total concurrency runs one batch of 2B: compare PSD at B with the SD row at 2B.
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
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
