"""Drafts that read the target, served on one GPU: an EAGLE-3 head, a draft model and n-gram, each against AR.

    python benchmarks/eagle_bench.py --target /tmp/ckpt/8b --head /tmp/ckpt/8b-eagle3 --draft /tmp/ckpt/68m \
        --device cuda:0 --out OUT [--batches 1,8,32,64] [--ngram-batches 8,32] [--acceptance 0.7]

The target worker starts once (with `--synthetic-acceptance`: a random head's drafts are never the target's), each
drafter's worker once (the n-gram one on the CPU), and a coordinator per drafter and mode (`sd`, `psd`, and `ar`
once), each measured at every batch size by `minedraft bench --server` (concurrency = batch, twice as many
requests, 64-token prompts, `--output-len` tokens out). Each coordinator's step trace gives, per batch size, the
proposal's and the verify's worker compute and channel times (the target's channel time of an EAGLE verify is its
sending back of the hidden states, the draft's its receiving of them). Prints one line per (drafter, mode, batch)
and writes OUT/eagle_bench.json. With a synthetic acceptance the workload's text does not change what is accepted:
the n-gram rows measure its served cost, not its acceptance on a repetitive workload (docs/benchmarks.md has that
on the demo pair).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

APP = [sys.executable, "-m", "minedraft_app"]


def start(name: str, args: list[str], out: Path) -> tuple[subprocess.Popen, str]:
    """A service of `minedraft_app` on a free port: (its process, its address), once it listens."""
    port_file = out / f"{name}.port"
    port_file.unlink(missing_ok=True)
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 (the process writes it until stopped)
    proc = subprocess.Popen(
        [*APP, *args, "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 600
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not start: see {out / (name + '.log')}")
        time.sleep(0.5)
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def trace_times(path: Path) -> dict[int, dict[str, float]]:
    """Per batch size: median proposal and verify worker compute and channel times (ms) of a step trace."""
    calls: dict[tuple[str, int], list[dict]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        event = json.loads(line)
        if event["kind"] in ("propose", "verify"):
            calls.setdefault((event["kind"], event["batch_size"]), []).append(event)
    out: dict[int, dict[str, float]] = {}
    for (kind, batch), events in calls.items():
        row = out.setdefault(batch, {})
        for field in ("worker_compute_s", "channel_s", "worker_s"):
            row[f"{kind}_{field[:-2]}_ms"] = round(1e3 * statistics.median(e[field] for e in events), 3)
        row[f"{kind}_calls"] = len(events)
    return out


def measure(address: str, batch: int, args: argparse.Namespace, out: Path, name: str) -> dict[str, Any]:
    """One load on a running server: its summary (output tokens/s, accepted length, ...)."""
    report = out / f"{name}.json"
    command = [
        *APP,
        "bench",
        "--server",
        address,
        "--concurrency",
        str(batch),
        "--num-prompts",
        str(max(2 * batch, 4)),
        "--prompt-len",
        "64",
        "--output-len",
        str(args.output_len),
        "--tokenizer",
        args.target,
        "--no-progress",
        "--json-out",
        str(report),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.load_timeout)
    if done.returncode or not report.exists():
        return {"error": (done.stderr or done.stdout)[-400:]}
    summary = next(iter(json.loads(report.read_text())["results"].values()))
    keys = ("output_throughput", "mean_accepted_length", "failed")
    return {key: summary[key] for key in keys} | {"tpot_ms_p50": summary["tpot_ms"]["p50"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--head", required=True, help="an EAGLE-3 head for the target")
    parser.add_argument("--draft", required=True, help="a draft model for the target")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--ngram-batches", default="8,32")
    parser.add_argument("--modes", default="sd,psd", help="speculative modes measured per drafter (ar once)")
    parser.add_argument("--drafters", default="eagle3,draft,ngram")
    parser.add_argument("--acceptance", type=float, default=0.7, help="the target's --synthetic-acceptance")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--load-timeout", type=float, default=120)
    parser.add_argument("--out", type=Path, default=Path("out/eagle_bench"))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (a timeout's TERM still stops the services)
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    biggest = max(batches + [int(b) for b in args.ngram_batches.split(",")])
    common = ["--dtype", "bfloat16", "--max-batch-size", str(biggest), "--max-model-len", "1024"]
    drafters = {
        "eagle3": (["--model", args.head, "--target-model-for-draft", args.target, "--device", args.device], batches),
        "draft": (["--model", args.draft, "--device", args.device], batches),
        "ngram": (
            [
                "--speculative-method",
                "ngram",
                "--target-model-for-draft",
                args.target,
                "--model",
                args.target,
                "--device",
                "cpu",
            ],
            [int(b) for b in args.ngram_batches.split(",")],
        ),
    }
    target, target_address = start(
        "target",
        [
            "target",
            "--model",
            args.target,
            "--device",
            args.device,
            "--synthetic-acceptance",
            str(args.acceptance),
            *common,
        ],
        args.out,
    )
    rows: list[dict[str, Any]] = []
    runs: list[tuple[str, str]] = [("ar", "ar")]
    runs += [(name, mode) for name in args.drafters.split(",") for mode in args.modes.split(",")]
    draft_procs: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, mode in runs:
            drafter = "draft" if name == "ar" else name
            if drafter not in draft_procs:
                draft_procs[drafter] = start(f"draft_{drafter}", ["draft", *drafters[drafter][0], *common], args.out)
            trace = args.out / f"trace_{name}_{mode}.jsonl"
            coordinator, address = start(
                f"coordinator_{name}_{mode}",
                [
                    "coordinator",
                    "--target",
                    target_address,
                    "--draft",
                    draft_procs[drafter][1],
                    "--mode",
                    mode,
                    "--max-batch-size",
                    str(biggest),
                    "--num-speculative-tokens",
                    str(args.k),
                    "--speculation",
                    "always",
                    "--step-trace",
                    str(trace),
                    "--tokenizer",
                    args.target,
                    "--http-port",
                    "0",  # gRPC only: FastAPI is not on every GPU machine
                ],
                args.out,
            )
            measured = {}
            try:
                measure(address, 2, args, args.out, f"warmup_{name}_{mode}")  # (graphs captured at first use)
                for batch in drafters[drafter][1] if name != "ar" else sorted(set(batches) | {8, 32}):
                    measured[batch] = measure(address, batch, args, args.out, f"load_{name}_{mode}_{batch}")
            finally:
                stop(coordinator)
            steps = trace_times(trace)
            for batch, result in measured.items():
                row = {"drafter": name, "mode": mode, "batch": batch, **result, **steps.get(batch, {})}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for proc, _ in draft_procs.values():
            stop(proc)
        stop(target)
    ar = {r["batch"]: r.get("output_throughput") for r in rows if r["mode"] == "ar"}
    for row in rows:
        if row["mode"] != "ar" and ar.get(row["batch"]) and row.get("output_throughput"):
            row["over_ar"] = round(row["output_throughput"] / ar[row["batch"]], 3)
            share = row.get("verify_channel_ms", 0) + row.get("propose_channel_ms", 0)
            step = row.get("verify_worker_ms", 0) + row.get("propose_worker_ms", 0)
            row["channel_share_of_step"] = round(share / step, 4) if step else None
            print(
                f"{row['drafter']:>7} {row['mode']:>3} B={row['batch']:<3} {row['over_ar']:.2f}x AR, "
                f"proposal {row.get('propose_worker_compute_ms')} ms, verify {row.get('verify_worker_compute_ms')} "
                f"ms, channel share {row['channel_share_of_step']}",
                flush=True,
            )
    (args.out / "eagle_bench.json").write_text(
        json.dumps({"config": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
