"""What the GPU benches share: a verifier/proposer pair stepped in process, timing, and the run's flags and summary."""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from benchmarks.shaped_checkpoint import SHAPES, VOCAB
from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.sampling import SamplingConfig
from target_service.verifier import Verifier


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


def timed(fn: Callable[[], object], devices: list[str]) -> float:
    for d in set(devices):
        torch.cuda.synchronize(d)
    start = time.perf_counter()
    fn()
    for d in set(devices):
        torch.cuda.synchronize(d)
    return time.perf_counter() - start


class Pair:
    """Verifier and proposer over two batches, driven step by step like the coordinator would; `graphs`: CUDA
    graphs, `compiled`: torch.compile'd decoder layers."""

    def __init__(
        self,
        target: PreTrainedModel,
        draft: PreTrainedModel,
        batch: int,
        k: int,
        prefix: int,
        synthetic: float | None,
        steps: int,
        graphs: bool = True,
        compiled: bool = False,
    ) -> None:
        # A cache as long as the services' default (--max-model-len 2048): reading a row's first kv_len keys out of a
        # longer row is what a served step does (a cache just long enough read whole rows, faster).
        max_len = max(2048, prefix + (steps + 4) * (k + 1) * 3 + 16)
        self.verifier = Verifier(
            ModelRunner(target, 2 * batch, max_len, graphs, compiled), [], synthetic_acceptance=synthetic
        )
        self.verifier.warm_up(k)
        self.proposer = Proposer(ModelRunner(draft, 2 * batch, max_len, graphs, compiled))
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


def base_parser(description: str | None) -> argparse.ArgumentParser:
    """A parser with the flags both benches take: devices, models, prompts, acceptance, output, compiling."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-device", default="cuda:0")
    parser.add_argument("--draft-device", default="cuda:0")
    parser.add_argument("--target", help="real target checkpoint directory (default: random, --target-shape)")
    parser.add_argument("--target-shape", default="8b", choices=sorted(SHAPES), help="the random target's shape")
    parser.add_argument("--draft", action="append", help="real draft checkpoint directories")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument(
        "--synthetic-acceptance",
        type=float,
        default=0.7,
        help="BENCHMARK ONLY, not lossless: accept each draft with this probability",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "out/gpu"))
    parser.add_argument(
        "--compile-modes",
        default="off",
        help="off, on or off,on: without and/or with torch.compile'd decoder layers, side by side "
        "(compiling is in place, so off is measured first)",
    )
    return parser


def begin(args: argparse.Namespace, eager: bool = False) -> tuple[dict, float]:
    """Diagnostics set up, --out made; the run's summary as it starts, and the HBM bandwidth measured."""
    # `timeout -s USR1` then shows where every thread is, should a run hang.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    summary: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "eager": eager,
        "synthetic_acceptance": args.synthetic_acceptance,
        "torch": torch.__version__,
    }
    bandwidth = hbm_bandwidth(args.target_device)
    summary["hbm_bandwidth_GBps"] = bandwidth / 1e9
    print(f"HBM copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    return summary, bandwidth


def save(args: argparse.Namespace, summary: dict, rows: list[dict], timeline: list[dict]) -> None:
    """gpu_bench.json in --out (the name the results and gpu_run.sh read); called after every stage."""
    document = {"summary": summary, "rows": rows, "timeline": timeline}
    (Path(args.out) / "gpu_bench.json").write_text(json.dumps(document, indent=1))
