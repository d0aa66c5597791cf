"""Where served worker calls spend their time, from the workers' PyTorch profiles, side by side for several runs.

A worker started with `--profile-dir` (`MINEDRAFT_PROFILE_DIR`; `services_bench.py --services-profile` sets it) writes
Chrome traces of a few calls after its first 100: `<call>_<pid>_<n>.json.gz`. Per kind of call this prints the medians
over its traces of: the call's span on the host, the host time before its first launch (graph or kernel; the GPU idles
meanwhile unless other work is queued), the host's operators and CUDA API calls, what made the host wait for the device,
and the GPU's kernel and copy time, of which the all-reduces' (NCCL kernels: a tensor-parallel rank's share of a step
spent reducing). Then the host operators that differ most between the first run and each other one.
An A/B of two trees (`gpu_run.sh ab services ...` with `EXTRA=--services-profile`):

    python benchmarks/call_profiles.py old/run/services/profiles_68m_timesliced_cuda-ipc.tar.gz \\
        run/services/profiles_68m_timesliced_cuda-ipc.tar.gz

Each argument is a directory of traces or a `.tar.gz` of one.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHES = ("cudaGraphLaunch", "cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
ALL_REDUCE = re.compile(r"nccl|all_?reduce", re.IGNORECASE)  # the kernels of a tensor-parallel all-reduce
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaStreamWaitEvent")


@dataclass
class CallProfile:
    """One call's figures, in microseconds."""

    span: float
    before_launch: float
    host_ops: float  # top-level operators, summed
    op_count: int
    launches: int
    waits: float
    kernels: float
    all_reduce: float  # of `kernels`
    copies: float
    ops: dict[str, float] = field(default_factory=dict)  # top-level operator -> total time
    api: dict[str, float] = field(default_factory=dict)  # CUDA API call -> total time


def _top_level(events: list[dict]) -> list[dict]:
    """The events not nested in another of the same thread."""
    top: list[dict] = []
    ends: dict[object, float] = {}
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= ends.get(e.get("tid"), float("-inf")):
            top.append(e)
            ends[e.get("tid")] = e["ts"] + e.get("dur", 0)
    return top


def profile_of(path: Path) -> CallProfile | None:
    """The figures of one trace; None where the call ran no operator (a release of nothing)."""
    with gzip.open(path) as trace:
        events = [e for e in json.load(trace)["traceEvents"] if e.get("ph") == "X"]
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")]
    if not host:
        return None
    start = min(e["ts"] for e in host)
    end = max(e["ts"] + e.get("dur", 0) for e in host)
    api = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launches = sorted(e["ts"] for e in api if e["name"] in LAUNCHES)
    top = _top_level([e for e in events if e.get("cat") == "cpu_op"])
    ops: dict[str, float] = collections.defaultdict(float)
    for e in top:
        ops[e["name"]] += e.get("dur", 0)
    calls: dict[str, float] = collections.defaultdict(float)
    for e in api:
        calls[e["name"]] += e.get("dur", 0)
    return CallProfile(
        span=end - start,
        before_launch=(launches[0] - start) if launches else end - start,
        host_ops=sum(ops.values()),
        op_count=len(top),
        launches=len(launches),
        waits=sum(e.get("dur", 0) for e in api if e["name"].startswith(WAITS)),
        kernels=sum(e.get("dur", 0) for e in events if e.get("cat") == "kernel"),
        all_reduce=sum(e.get("dur", 0) for e in events if e.get("cat") == "kernel" and ALL_REDUCE.search(e["name"])),
        copies=sum(e.get("dur", 0) for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")),
        ops=dict(ops),
        api=dict(calls),
    )


def load(source: Path, scratch: Path) -> dict[str, list[CallProfile]]:
    """Each kind of call's profiles in a directory of traces (or a .tar.gz of one)."""
    if source.is_file():
        target = scratch / f"{len(list(scratch.iterdir()))}"
        with tarfile.open(source) as archive:
            archive.extractall(target, filter="data")
        source = target
    calls: dict[str, list[CallProfile]] = collections.defaultdict(list)
    for path in sorted(source.rglob("*.json.gz")):
        profile = profile_of(path)
        if profile is not None:
            calls[re.sub(r"_\d+_\d+\.json\.gz$", "", path.name)].append(profile)
    return calls


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="directories of traces, or .tar.gz archives of them")
    parser.add_argument("--top", type=int, default=12, help="operators and API calls listed per kind of call")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        runs = [load(run, Path(scratch)) for run in args.runs]
    print("runs: " + "; ".join(f"[{i}] {run}" for i, run in enumerate(args.runs)))
    rows = (
        ("span on the host", "span"),
        ("host before the first launch", "before_launch"),
        ("top-level host operators", "host_ops"),
        ("host waiting for the device", "waits"),
        ("GPU kernels", "kernels"),
        ("  of which all-reduces", "all_reduce"),
        ("GPU copies and sets", "copies"),
        ("operators (count)", "op_count"),
        ("launches (count)", "launches"),
    )
    for kind in sorted(set().union(*runs)):
        profiles = [run.get(kind, []) for run in runs]
        print(f"\n{kind} (traces: {', '.join(str(len(p)) for p in profiles)}; median us)")
        for label, attribute in rows:
            cells = [median([getattr(p, attribute) for p in ps]) for ps in profiles]
            print(f"  {label:30s}" + "".join(f"{c:12.1f}" for c in cells))
        for what in ("ops", "api"):
            totals = [
                {
                    key: median([getattr(p, what).get(key, 0.0) for p in ps])
                    for key in {k for p in ps for k in getattr(p, what)}
                }
                for ps in profiles
            ]
            first, others = totals[0], totals[1:]
            # Those that differ most from the first run in any other; of one run alone, the costliest.
            order = sorted(
                set().union(*totals),
                key=lambda k: -max((abs(t.get(k, 0.0) - first.get(k, 0.0)) for t in others), default=first.get(k, 0.0)),
            )
            print(f"  {'host operators' if what == 'ops' else 'CUDA API calls'}:")
            for key in order[: args.top]:
                print(f"    {key[:60]:60s}" + "".join(f"{t.get(key, 0.0):10.1f}" for t in totals))


if __name__ == "__main__":
    main()
