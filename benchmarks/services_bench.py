"""PSD against SD and AR through the real services on the GPUs: `minedraft bench` runs, their step traces summed up.

    python benchmarks/services_bench.py --services 68m:timesliced --out out/gpu

On one GPU the services are separate processes sharing it, with and without CUDA MPS; on two GPUs
(`--draft-device cuda:1`) once per channel (`--services-channels cuda-ipc,nccl`), plus SD with the draft on the
target's GPU and SD on two independent stacks. Each run is `minedraft bench --modes ...` in this process: its
stacks start and stop through `minedraft_app.stack`. Step times in process are `benchmarks/step_bench.py`;
`benchmarks/gpu_run.sh` holds the command lines a GPU session runs (`services`, `profile`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

sys.path.insert(0, ".")
from benchmarks.gpu_common import base_parser, begin, save  # noqa: E402
from benchmarks.gpu_plots import plot_timelines  # noqa: E402
from benchmarks.services_runs import ServicesRun, services_plan, steady_state, trace_stats, two_gpu_summary  # noqa: E402
from benchmarks.shaped_checkpoint import shaped_checkpoint  # noqa: E402
from minedraft_app import cli  # noqa: E402
from minedraft_app.flags import PRECAPTURE_CHOICES  # noqa: E402
from minedraft_app.stack import command_line  # noqa: E402


def bench_in_process(command: list[str], env: dict[str, str], seconds: float, label: str) -> None:
    """`minedraft bench` (`command`) in this process, `env` added to its services' environment. Past `seconds` a
    SIGINT stops it as a Ctrl-C would: it stops its stacks and reports the modes that finished; a second one 30 s
    later kills whatever of its stacks is still running."""
    alarms: list[int] = []

    def alarm(signum: int, frame: object) -> None:
        alarms.append(signum)
        if len(alarms) == 1:
            print(f"services, {label}: timed out after {seconds} s", flush=True)
            signal.setitimer(signal.ITIMER_REAL, 30)
        signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        # sys.argv: what bench's JSON report records as its command line
        with mock.patch.dict(os.environ, env), mock.patch.object(sys, "argv", [sys.argv[0], *command]):
            cli.main(command)
    except KeyboardInterrupt:
        if not alarms:
            raise
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def bench_command(
    run: ServicesRun, args: argparse.Namespace, models: dict[str, str], root: Path, compiled: bool
) -> list[str]:
    """The `minedraft bench` arguments of `run`, on `models` (target and draft checkpoint directories), its outputs
    (services_/traces_/logs_LABEL) in `root`."""
    flags: dict[str, object] = {
        "--modes": run.modes,
        "--target": models["target"],
        "--draft": models[run.draft],
        "--target-device": args.target_device,
        "--draft-device": run.draft_device,
        "--channel": run.channel,
        "--dtype": "bfloat16",
        "--num-speculative-tokens": 4,
        "--max-batch-size": args.services_batch,
        "--overlap": args.services_overlap,
        "--speculation": args.services_speculation,
        "--min-speculative-tokens": args.services_min_speculative_tokens,
        "--synthetic-acceptance": args.synthetic_acceptance,
        "--num-prompts": args.services_prompts or 2 * args.services_batch,
        "--prompt-len": args.prefix,
        "--output-len": args.services_output_len,
        "--no-progress": True,
        "--json-out": root / f"services_{run.label}.json",
        "--step-trace-dir": root / f"traces_{run.label}",
        "--log-dir": root / f"logs_{run.label}",
        "--compile": compiled,
        "--concurrency": args.services_concurrency or False,  # (none given: bench's own, two full batches)
        "--precapture-graphs": args.services_precapture,
        "--tensor-parallel-size": args.tensor_parallel_size,
        "--draft-tensor-parallel-size": args.draft_tensor_parallel_size,
    }
    return ["bench", *command_line(flags)]


def collect(
    run: ServicesRun, root: Path, out: Path, results: dict[str, dict], timelines: dict[str, list[dict]]
) -> None:
    """What `run`'s bench left in `root`: its logs, traces and profiles copied to `out`, its report and the
    statistics of its step traces (`trace_stats`, `steady_state`) into `results`, PSD's steady steps into
    `timelines`."""
    label = run.label
    if (root / f"logs_{label}").exists():
        shutil.copytree(root / f"logs_{label}", out / f"logs_{label}", dirs_exist_ok=True)
    for log in sorted((root / f"logs_{label}").glob("*.log")):  # the services' own output, for diagnosis
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(f"--- {log.name} (last lines) ---\n{tail}", flush=True)
    if (root / f"services_{label}.json").exists():
        results[label] = json.loads((root / f"services_{label}.json").read_text())
    if (root / f"profiles_{label}").exists():
        shutil.make_archive(str(out / f"profiles_{label}"), "gztar", root / f"profiles_{label}")
    print(f"services, {label}: {results.get(label, {}).get('ratios')}", flush=True)
    traces = root / f"traces_{label}"
    if traces.exists():
        shutil.copytree(traces, out / f"traces_{label}", dirs_exist_ok=True)
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


def services_comparison(
    runs: list[str], args: argparse.Namespace, summary: dict, save_now: Callable[[], None], compiled: bool
) -> None:
    """PSD, SD and AR through the real services: `minedraft bench --modes ...` as `services_plan` lays out (`runs`
    are draft shapes or --draft directories' names, on one GPU optionally `SHAPE:timesliced` or `SHAPE:mps`), on
    the --target and --draft checkpoints, else on shaped ones with random weights written for the run
    (`shaped_checkpoint`: prompts come from the demo tokenizer, whose ids are valid in the 128k vocabulary)."""
    mps = shutil.which("nvidia-cuda-mps-control")
    plan = services_plan(runs, args, mps is not None, compiled)
    root = Path(tempfile.mkdtemp(prefix="minedraft-services-"))
    # Kept for later calls on the same machine: a 70B-shaped target takes minutes to write.
    kept = Path(args.checkpoint_dir)
    models = {
        "target": str(args.target or shaped_checkpoint(args.target_shape, kept / args.target_shape, args.target_device))
    }
    given = {Path(d).name: d for d in args.draft or []}
    for name in sorted({r.draft for r in plan}):
        models[name] = str(given.get(name) or shaped_checkpoint(name, kept / name, args.draft_device))
    results: dict[str, dict] = summary.setdefault("services", {})
    summary["services_tensor_parallel_size"] = args.tensor_parallel_size
    summary["services_draft_tensor_parallel_size"] = args.draft_tensor_parallel_size
    timelines: dict[str, list[dict]] = summary.setdefault("services_timelines", {})
    for i, run in enumerate(plan):
        env: dict[str, str] = {}
        if args.services_profile:  # every worker of these stacks traces five calls after its first 100
            env["MINEDRAFT_PROFILE_DIR"] = str(root / f"profiles_{run.label}")
        if run.mps:
            assert mps is not None
            pipe = tempfile.mkdtemp(prefix="mps-")
            env.update(CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=pipe)
            subprocess.run([mps, "-d"], env=os.environ | env, check=True)  # a user-level daemon: no GPU setting changes
        command = bench_command(run, args, models, root, compiled)
        print(f"[services {i + 1}/{len(plan)}] {run.label}: minedraft {' '.join(command)}", flush=True)
        try:
            bench_in_process(command, env, args.services_timeout, run.label)
        finally:
            if run.mps and mps is not None:
                subprocess.run([mps], input=b"quit\n", env=os.environ | env, check=False)
        collect(run, root, Path(args.out), results, timelines)
        save_now()
    if args.target_device != args.draft_device:
        two = summary.setdefault("two_gpu", {})
        for name in sorted({r.draft for r in plan}):
            for channel in args.services_channels.split(","):
                key = f"{name}_{channel}" + ("_compiled" if compiled else "")
                two[key] = two_gpu_summary(results, name, channel, compiled)
        print(f"two GPUs: {json.dumps(two, indent=1)}", flush=True)
        save_now()
    shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = base_parser(__doc__)
    parser.add_argument(
        "--services",
        default="68m",
        help="draft shapes to run through the real services, on one GPU time-sliced and under MPS (e.g. 68m), or "
        "one way only (e.g. 68m,1b:mps)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="/tmp/minedraft-shaped-ckpt",
        help="where the services' random checkpoints are written once per shape, and found by later runs",
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
        help="the target's --tensor-parallel-size (its ranks on the GPUs from --target-device on; give a "
        "--draft-device past them)",
    )
    parser.add_argument(
        "--draft-tensor-parallel-size",
        type=int,
        default=1,
        help="the draft's --tensor-parallel-size (its ranks on the GPUs from --draft-device on)",
    )
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
    args = parser.parse_args()
    summary, _ = begin(args)
    compiled = "on" in args.compile_modes.split(",")  # one run of each: compiled if asked for at all
    services_comparison(args.services.split(","), args, summary, lambda: save(args, summary, [], []), compiled)
    if summary["services_timelines"]:
        plot_timelines(summary["services_timelines"], Path(args.out))
    save(args, summary, [], [])
    print(f"\nsynthetic acceptance {args.synthetic_acceptance} (benchmark only); {summary['gpu']}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
