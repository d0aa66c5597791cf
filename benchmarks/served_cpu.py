"""CPU time each service spends per step of a served load, on a CPU, A/B between two trees.

    python benchmarks/served_cpu.py                          # this tree
    git worktree add /tmp/slot 607e410
    python benchmarks/served_cpu.py --against /tmp/slot      # that tree, this, this, that; and the ratios

A tiny Llama pair (64 hidden; the services' Python, not the model, is what it weighs) is served with `minedraft
bench --modes sd` (`--speculation always`, synthetic acceptance 0.7, one thread per service, 64 streams, batches of
32). While it runs, each service's CPU time is read from /proc, per thread; the figure is CPU milliseconds per verify
step over the middle 60% of the steps (the step trace's times), when every batch is full. On a GPU host the
coordinator's share of this sits between the workers' calls (the step loop) or competes with it (the streams); the
workers' includes their CPU forwards, which a GPU runs instead. With --host-only the workers skip the model's layers
(its embeddings stand for the last hidden state, the logits still computed): their figure is then their host work,
the step bodies' sampling and bookkeeping included, and a change of a few percent in it stands out of the noise.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minedraft.demo_models import TARGET_DIR  # noqa: E402

SERVICES = ("coordinator", "target", "draft")

# --host-only: a sitecustomize the services import at start-up, found first on PYTHONPATH. The layers run while the
# KV cache probes the model (it records their shapes), skipped after.
HOST_ONLY_SITE = """
import sys
if any(name in sys.orig_argv[1:5] for name in ("target", "draft")):
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.llama import modeling_llama

    layers = modeling_llama.LlamaModel.forward

    def embeddings_only(self, input_ids=None, attention_mask=None, position_ids=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or getattr(cache, "_probing", False) or input_ids is None:
            return layers(self, input_ids, attention_mask, position_ids, *args, **kwargs)
        hidden = self.embed_tokens(input_ids)
        output = BaseModelOutputWithPast(last_hidden_state=hidden)
        if kwargs.get("output_hidden_states"):
            output.hidden_states = (hidden,) * (len(self.layers) + 1)
        return output

    modeling_llama.LlamaModel.forward = embeddings_only
"""


def tiny_pair(root: Path) -> tuple[Path, Path]:
    """A 2-layer target and a 1-layer draft of 64 hidden units with random weights, and the demo tokenizer."""
    dirs = []
    for name, layers in (("target", 2), ("draft", 1)):
        torch.manual_seed(layers)
        config = LlamaConfig(
            vocab_size=4096,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        )
        LlamaForCausalLM(config).save_pretrained(root / name)
        for f in [*TARGET_DIR.glob("tokenizer*"), TARGET_DIR / "special_tokens_map.json"]:
            shutil.copy(f, root / name)
        dirs.append(root / name)
    return dirs[0], dirs[1]


def cpu_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds of each thread name of process `pid` (user + system); its main thread (the event loop) as "main",
    apart from the other Python threads (a worker's compute thread), which share its name."""
    tick, seconds = os.sysconf("SC_CLK_TCK"), collections.defaultdict[str, float](float)
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = "main" if int(tid) == pid else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds[name] += (int(fields[11]) + int(fields[12])) / tick
    return dict(seconds)


def service_pids(bench: int) -> dict[str, int]:
    """The services a bench process started (its children), by name."""
    pids = {}
    for line in subprocess.run(["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout.splitlines()[1:]:
        pid, ppid, *args = line.split()
        for service in SERVICES:
            line_args = " ".join(args)  # (`python -m minedraft_app target ...`; before 2026-12-06 `minedraft target`)
            if int(ppid) == bench and any(f"{app} {service}" in line_args for app in ("minedraft", "minedraft_app")):
                pids[service] = int(pid)
    return pids


def one_run(tree: str, target: Path, draft: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """CPU ms per verify step of each service (per thread name) in one served load run from `tree`."""
    with tempfile.TemporaryDirectory() as traces:
        app = "minedraft_app" if Path(tree, "minedraft_app").is_dir() else "minedraft"  # (before 2026-12-06)
        command = [
            sys.executable, "-m", app, "bench", "--modes", "sd", "--target", str(target), "--draft",
            str(draft), "--num-prompts", str(args.prompts), "--concurrency", "64", "--max-batch-size", "32",
            "--output-len", "96", "--synthetic-acceptance", "0.7", "--speculation", "always", "--threads", "1",
            "--step-trace-dir", traces, "--no-progress",
        ]  # fmt: skip
        env = dict(os.environ)
        if args.host_only:
            site = Path(traces, "site")
            site.mkdir()
            (site / "sitecustomize.py").write_text(HOST_ONLY_SITE)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
        bench = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples: list[tuple[float, dict[str, dict[str, float]]]] = []
        pids: dict[str, int] = {}
        while bench.poll() is None:
            if len(pids) < len(SERVICES):  # (looked up until all three run: `ps` costs the services' CPU)
                pids = service_pids(bench.pid)
            snapshot = {}
            for service, pid in pids.items():
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # (it ended meanwhile)
                    snapshot[service] = cpu_by_thread(pid)
            if snapshot:
                samples.append((time.monotonic(), snapshot))  # (the trace's clock: CLOCK_MONOTONIC too)
            time.sleep(0.05)
        events = [json.loads(line) for line in Path(traces, "sd.jsonl").read_text().splitlines()]
    starts = sorted(e["start"] for e in events if e["kind"] == "verify")
    low, high = starts[len(starts) // 5], starts[4 * len(starts) // 5]
    steps = sum(low <= s < high for s in starts)
    times = [t for t, _ in samples]
    before, after = (samples[min(bisect.bisect(times, t), len(samples) - 1)][1] for t in (low, high))
    per_step = {}
    for service in after.keys() & before.keys():
        used = after[service]
        per_step[service] = {name: (used[name] - before[service].get(name, 0.0)) * 1e3 / steps for name in used}
    return per_step


def summary(runs: list[dict[str, dict[str, float]]]) -> dict[str, float]:
    """The median over runs of each service's CPU ms per step, of its busiest thread's and of its main thread's (the
    event loop: gRPC handlers, where a worker's compute thread runs the model)."""
    out = {}
    for service in SERVICES:
        totals = [sum(r[service].values()) for r in runs if service in r]
        busiest = [max(r[service].values()) for r in runs if service in r]
        main = [r[service].get("main", 0.0) for r in runs if service in r]
        if totals:
            out[service] = statistics.median(totals)
            out[f"{service} (busiest thread)"] = statistics.median(busiest)
            out[f"{service} (main thread)"] = statistics.median(main)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", help="another tree (a checkout) to run the same load from, alternating")
    parser.add_argument("--prompts", type=int, default=512, help="requests of the load")
    parser.add_argument("--host-only", action="store_true", help="the workers skip the model's layers (docstring)")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    trees = [args.against, here, here, args.against] if args.against else [here]
    with tempfile.TemporaryDirectory() as root:
        target, draft = tiny_pair(Path(root))
        runs: dict[str, list[dict[str, dict[str, float]]]] = collections.defaultdict(list)
        for tree in trees:
            runs[tree].append(one_run(tree, target, draft, args))
            line = ", ".join(f"{k} {v:.2f}" for k, v in summary(runs[tree][-1:]).items())
            print(f"ran in {tree}: {line}", flush=True)
    print(f"{'CPU ms per verify step':34s}" + "".join(f"{t:>22s}" for t in dict.fromkeys(trees)))
    figures = {tree: summary(r) for tree, r in runs.items()}
    for key in figures[here]:
        cells = [figures[t].get(key, float("nan")) for t in dict.fromkeys(trees)]
        ratio = f"   ({cells[-1] / cells[0]:.2f}x)" if len(cells) > 1 and cells[0] else ""
        print(f"{key:34s}" + "".join(f"{c:22.2f}" for c in cells) + ratio)


if __name__ == "__main__":
    main()
