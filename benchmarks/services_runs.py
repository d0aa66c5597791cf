"""The runs of a services comparison (`services_plan`) and the figures their step traces and reports give."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


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


def services_plan(runs: list[str], args: argparse.Namespace, mps_available: bool, compiled: bool) -> list[ServicesRun]:
    """On one GPU each draft shape time-sliced and under MPS (or as `SHAPE:timesliced` / `SHAPE:mps`); on two GPUs
    PSD, SD and AR once per channel, SD with the draft on the target's GPU (the paper's baseline), and SD on two
    independent stacks, one per GPU (`sddp`: data parallel, what a user with two GPUs would otherwise run; not with
    tensor parallelism)."""
    suffix = "_compiled" if compiled else ""
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


def two_gpu_summary(results: dict[str, dict], name: str, channel: str, compiled: bool) -> dict:
    """PSD on two GPUs over the whole load against SD with the draft on the target's GPU and on its own, SD at the
    same total concurrency (`sd2b`: one batch of 2B), SD on two independent stacks (`sddp`) and AR; and the steady
    state."""
    suffix = "_compiled" if compiled else ""
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
