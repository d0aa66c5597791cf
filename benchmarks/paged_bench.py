"""Serving benchmark of the paged KV cache: long contexts, connect time, prefix caching, the first requests.

    python benchmarks/paged_bench.py --device cuda --out out/paged

Four questions (`--questions`), each on real services (target, draft and coordinator processes, started as
`minedraft bench --modes` starts them: `minedraft_app.bench.LocalStack`), all on one device:

- long: `--requests` requests sent at once, prompts of random token ids and random lengths in
  [`--prompt-min`, `--prompt-max`], `--output-len` tokens each (EOS ignored), at `--max-model-len`: completed and
  failed requests, wall time, output tokens/s, TTFT, each worker's peak KV blocks used (its /metrics
  `minedraft_worker_kv_blocks_used`, polled every `--poll-interval` s during the load) and the coordinator's
  preemptions (its /metrics `minedraft_preemptions_total`, counted over the load).
- connect: seconds from starting a stack until its coordinator reports SERVING, with `--precapture-graphs on`, at
  each of `--connect-lens` (a stack each), side by side; with the workers' precapture log lines.
- prefix: `--prefix-requests` requests sent at once, sharing their first `--prefix-len` token ids, then
  `--suffix-min`..`--suffix-max` random ids each; TTFT p50 and p90 and the sum of Usage.cached_prompt_tokens with
  `--enable-prefix-caching on` against `off` (a stack each).
- first: on a fresh stack (no request served yet), `--first-requests` requests one after the other, prompts of
  `--first-prompt-len` random ids: the TTFT of the first and of the last (the tenth by default).

Stacks are shared where a question allows it: the stack of the last connect length (when it equals
`--max-model-len`) serves the first requests while still fresh, then the long load, then the prefix caching "on"
half (after `--warmup` requests on a stack that has not served yet, so that both halves are warm); "off" gets a stack
of its own. So a full run starts three stacks, not six. TTFT is the time to the first streamed message with tokens.

Models: `--target`/`--draft` directories; by default on CUDA an 8B-shaped target and a 68M-shaped draft with random bf16
weights written by `benchmarks/shaped_checkpoint.py` (in a child process, so that this one holds no GPU memory) with the
context raised to the longest length asked for, once under `--checkpoint-dir` and reused by later runs; on a CPU the
shipped demo pair (`minedraft/demo_models`). Random weights accept no drafts, so with `--speculation auto` (the default)
the target mostly decodes alone; `--synthetic-acceptance P` changes that (benchmark only, not lossless).

KV cache memory: `serve`/`bench` stacks pass one `--kv-cache-memory` to both workers (without it, on one GPU they
split `--gpu-memory-utilization` 80/20). For fixed, comparable pools each worker gets its own value here:
`--target-kv-cache-memory` and `--draft-kv-cache-memory` (appended to that worker's command line, after the stack's
flags), else `--kv-cache-memory` for both, else on CUDA 80 GiB for the target and 12 GiB for the draft. On an H200
(139 GiB) that leaves ~45 GiB for the 8B target's 16 GiB of weights, both workers' graphs and activations and the
draft; 80 GiB of an 8B target's 128 KiB per token hold ~655k tokens, more than the default long load's peak (128 x
~3,000 = ~385k), and 12 GiB of the 68M draft's 6 KiB per token ~2M tokens. A smaller target value (e.g. 24) makes
the long load preempt.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, ".")
from minedraft.demo_models import DRAFT_DIR, TARGET_DIR  # noqa: E402
from minedraft_app.bench import LocalStack, _no_nan, _server_info, percentile  # noqa: E402
from minedraft_app.cli import build_parser  # noqa: E402
from minedraft_app.stack import LOOPBACK, METRICS_PORT_OFFSET, start_stack  # noqa: E402

QUESTIONS = ("connect", "first", "long", "prefix")  # the order they run in: a stack passes from one to the next
WORKERS = ("target", "draft")
GPU_KV_GIB = {"target": 80.0, "draft": 12.0}  # the default on CUDA: see the module's docstring


# --------------------------------------------------------------------------------------------- models


def _build_pair(root: str, device: str, context: int) -> None:
    """The 8B- and 68M-shaped random-weight checkpoints under `root` (target/, draft/), unless there already."""
    from benchmarks.shaped_checkpoint import shaped_checkpoint

    for name, shape in (("target", "8b"), ("draft", "68m")):
        shaped_checkpoint(shape, Path(root) / name, device, context)


def model_dirs(args: argparse.Namespace) -> tuple[str, str]:
    """The target and draft directories: given, the demo pair on a CPU, or built (shaped, random weights)."""
    if args.target and args.draft:
        return args.target, args.draft
    if args.device == "cpu":
        return args.target or str(TARGET_DIR), args.draft or str(DRAFT_DIR)
    context = max([args.max_model_len, *args.connect_lens])
    process = multiprocessing.get_context("spawn").Process(
        target=_build_pair, args=(args.checkpoint_dir, args.device, context)
    )
    process.start()
    process.join()
    if process.exitcode:
        raise RuntimeError(f"building the shaped checkpoints failed (exit code {process.exitcode})")
    root = Path(args.checkpoint_dir)
    return args.target or str(root / "target"), args.draft or str(root / "draft")


# --------------------------------------------------------------------------------------------- stacks


def free_port_run(count: int) -> int:
    """A port such that it and the `count - 1` after it are free now (the services' /metrics ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            base = int(s.getsockname()[1])
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind((LOOPBACK, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} free ports in a row")


@dataclass(frozen=True)
class Settings:
    """What tells one stack from another here."""

    max_model_len: int
    precapture: str
    prefix_caching: str


class Stack(LocalStack):
    """A `LocalStack` whose workers each get their own --kv-cache-memory, with every service's /metrics on."""

    def __init__(self, base: argparse.Namespace, settings: Settings, label: str, log_dir: Path) -> None:
        args = argparse.Namespace(
            **vars(base)
            | {
                "max_model_len": settings.max_model_len,
                "precapture_graphs": settings.precapture,
                "enable_prefix_caching": settings.prefix_caching,
            }
        )
        super().__init__(args, base.mode, log_dir)
        self.settings = settings
        self.label = label
        self.log_path = log_dir / f"{label}.log"
        self.metrics_port = free_port_run(len(METRICS_PORT_OFFSET))
        self.args.metrics_port = self.metrics_port  # stack_commands gives each service its port from this one
        self.kv: dict[str, float | None] = base.worker_kv
        self.served = 0  # requests sent to it
        self.start_s = 0.0

    def start(self) -> None:
        with open(self.log_path, "w") as log:

            def popen(command: list[str]) -> subprocess.Popen:
                service = command[3]  # [python, -m, minedraft, SERVICE, ...]
                gib = self.kv.get(service)
                extra = ["--kv-cache-memory", str(gib)] if gib is not None else []  # the last one counts
                return subprocess.Popen(
                    [*command, *extra], env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )

            start = time.perf_counter()
            self.port = start_stack(self.args, popen, self.processes)
            self.start_s = time.perf_counter() - start

    def metrics_url(self, service: str) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port + METRICS_PORT_OFFSET[service]}/metrics"

    def scrape(self, service: str) -> dict[str, float]:
        return scrape(self.metrics_url(service))

    def log_lines(self, pattern: str) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [line.strip()[-220:] for line in text.splitlines() if re.search(pattern, line)]


def scrape(url: str, timeout: float = 2.0) -> dict[str, float]:
    """A Prometheus text page as {name (with its labels): value}; empty where it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


class BlockPoller(threading.Thread):
    """Each worker's KV blocks in use, from its /metrics every `interval` s while a load runs: the peak, and the
    samples."""

    def __init__(self, stack: Stack, interval: float) -> None:
        super().__init__(daemon=True)
        self.stack, self.interval = stack, interval
        self.done = threading.Event()
        self.peak = dict.fromkeys(WORKERS, 0.0)
        self.total = dict.fromkeys(WORKERS, 0.0)
        self.samples: list[list[float]] = []  # [seconds since the start, target's blocks used, draft's]
        self.start_time = time.perf_counter()

    def run(self) -> None:
        while True:
            row = [round(time.perf_counter() - self.start_time, 2)]
            for worker in WORKERS:
                values = self.stack.scrape(worker)
                used = values.get("minedraft_worker_kv_blocks_used", float("nan"))
                self.total[worker] = values.get("minedraft_worker_kv_blocks", self.total[worker])
                if used == used:
                    self.peak[worker] = max(self.peak[worker], used)
                row.append(used)
            self.samples.append(row)
            if self.done.wait(self.interval):
                return

    def stop(self) -> dict[str, Any]:
        self.done.set()
        self.join(timeout=10)
        return {
            worker: {
                "peak_blocks_used": int(self.peak[worker]),
                "num_blocks": int(self.total[worker]),
                "peak_usage": round(self.peak[worker] / self.total[worker], 4) if self.total[worker] else None,
            }
            for worker in WORKERS
        } | {"samples": len(self.samples), "timeline": self.samples[:: max(1, len(self.samples) // 600)]}


def preemptions(stack: Stack) -> float:
    return stack.scrape("coordinator").get("minedraft_preemptions_total", float("nan"))


# --------------------------------------------------------------------------------------------- load


@dataclass
class Result:
    ok: bool
    prompt_tokens: int
    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str = ""


async def _one(stub: Any, ids: list[int], max_tokens: int, index: int, timeout: float) -> Result:
    from minedraft.proto import generation_pb2

    params = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt_token_ids=ids, params=params, request_id=f"paged-{index}")
    start = time.perf_counter()
    result = Result(False, len(ids), 0.0)
    try:
        async for message in stub.Generate(request, timeout=timeout):
            if message.token_ids and result.ttft_s is None:
                result.ttft_s = time.perf_counter() - start
            result.tokens += len(message.token_ids)
            if message.finish_reason:
                result.cached_prompt_tokens = message.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    else:
        result.ok = True
    result.latency_s = time.perf_counter() - start
    return result


async def _send(address: str, prompts: list[list[int]], max_tokens: int, timeout: float, at_once: bool) -> list[Result]:
    from minedraft.proto import generation_pb2_grpc
    from minedraft.rpc.server_utils import CHANNEL_OPTIONS

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        if at_once:
            return list(await asyncio.gather(*(_one(stub, p, max_tokens, i, timeout) for i, p in enumerate(prompts))))
        return [await _one(stub, p, max_tokens, i, timeout) for i, p in enumerate(prompts)]


def send(
    stack: Stack, prompts: list[list[int]], max_tokens: int, args: argparse.Namespace, at_once: bool = True
) -> tuple[list[Result], float]:
    """Send `prompts` (all at once, or one after the other) to the stack; the results and the wall time."""
    stack.served += len(prompts)
    start = time.perf_counter()
    results = asyncio.run(_send(stack.address, prompts, max_tokens, args.timeout, at_once))
    return results, time.perf_counter() - start


def random_ids(rng: random.Random, vocab: int, length: int) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(length)]


def stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    stats: dict[str, float | None] = {f"p{q}": round(percentile(values, q) * 1e3, 2) for q in (50, 90, 99)}
    return stats | {"mean": round(sum(values) / len(values) * 1e3, 2)}


def load_summary(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in ok),
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "latency_ms": stats_ms([r.latency_s for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


# --------------------------------------------------------------------------------------------- the questions


class Bench:
    """The questions, on stacks handed from one question to the next where their settings match."""

    def __init__(self, args: argparse.Namespace, base: argparse.Namespace, out: Path) -> None:
        self.args, self.base, self.out = args, base, out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.stack: Stack | None = None
        self.failed: dict[Settings, str] = {}  # settings whose stack did not start
        self.rng = random.Random(args.seed)
        self.report: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": sys.argv,
            "config": {k: v for k, v in vars(args).items()},
            "results": {},
            "errors": {},
            "interrupted": False,
        }
        self.count = 0

    def save(self) -> None:
        (self.out / "paged_bench.json").write_text(json.dumps(_no_nan(self.report), indent=2) + "\n")

    def settings(self, max_model_len: int | None = None, precapture: str | None = None, prefix: str = "on") -> Settings:
        return Settings(max_model_len or self.args.max_model_len, precapture or self.args.precapture_graphs, prefix)

    def stack_for(self, settings: Settings, name: str, fresh: bool = False) -> tuple[Stack, bool]:
        """The running stack where it has these settings (and has served nothing, if `fresh`), else a new one; and
        whether it was reused."""
        if self.stack is not None and self.stack.settings == settings and not (fresh and self.stack.served):
            print(f"[{name}] reusing the stack {self.stack.label}", flush=True)
            return self.stack, True
        self.stop()
        if settings in self.failed:  # the same start-up would fail again, or time out again
            raise RuntimeError(f"not started again: {self.failed[settings]}")
        self.count += 1
        label = f"{self.count}_{name}"
        stack = Stack(self.base, settings, label, self.logs)
        print(f"[{name}] starting stack {label}: {settings}", flush=True)
        self.stack = stack
        try:
            stack.start()
        except (RuntimeError, TimeoutError) as exc:
            self.failed[settings] = f"stack {label} failed to start: {exc}"
            raise RuntimeError(f"{exc}\n--- {stack.log_path} ---\n{stack.log_tail()}") from exc
        print(f"[{name}] stack {label} serving after {stack.start_s:.1f} s", flush=True)
        return stack, False

    def stop(self) -> None:
        if self.stack is not None:
            start = time.perf_counter()
            self.stack.stop()
            print(f"stack {self.stack.label} stopped in {time.perf_counter() - start:.1f} s", flush=True)
            self.stack = None

    def vocab(self, stack: Stack) -> int:
        return int(_server_info(stack.address).get("vocab_size") or 1000)

    def warm_up(self, stack: Stack) -> None:
        """A few requests on a stack that has served none (not measured)."""
        if stack.served or not self.args.warmup:
            return
        vocab = self.vocab(stack)
        prompts = [random_ids(self.rng, vocab, self.args.prompt_min) for _ in range(self.args.warmup)]
        results, wall = send(stack, prompts, self.args.ttft_output_len, self.args)
        if not all(r.ok for r in results):
            raise RuntimeError(f"warm-up failed: {load_summary(results, wall)['errors']}")

    def connect(self) -> dict[str, Any]:
        """Start to SERVING, with precapture on, at each connect length; the last stack is kept."""
        out: dict[str, Any] = {}
        for length in self.args.connect_lens:
            stack, _ = self.stack_for(self.settings(length, "on"), f"connect{length}", fresh=True)
            info = _server_info(stack.address)
            out[str(length)] = {
                "connect_s": round(stack.start_s, 2),
                "max_model_len": info.get("max_model_len"),
                "precapture": stack.log_lines(r"step shapes .* ahead of serving|KV cache: \d+ blocks"),
            }
            print(f"[connect] max_model_len {length}: serving {stack.start_s:.1f} s after the start", flush=True)
            self.report["results"]["connect"] = out
            self.save()
        return out

    def first(self) -> dict[str, Any]:
        stack, reused = self.stack_for(self.settings(), "first", fresh=True)
        vocab = self.vocab(stack)
        prompts = [random_ids(self.rng, vocab, self.args.first_prompt_len) for _ in range(self.args.first_requests)]
        results, wall = send(stack, prompts, self.args.ttft_output_len, self.args, at_once=False)
        ttfts = [round(r.ttft_s * 1e3, 2) if r.ok and r.ttft_s is not None else None for r in results]
        out = {
            "stack_start_s": round(stack.start_s, 2),
            "reused_connect_stack": reused,
            "ttft_first_ms": ttfts[0],
            "ttft_last_ms": ttfts[-1],
            "ttft_ms": ttfts,
            "failed": sum(not r.ok for r in results),
            "errors": sorted({r.error for r in results if not r.ok})[:5],
        }
        print(f"[first] TTFT of requests 1..{len(ttfts)} (ms): {ttfts}", flush=True)
        return out

    def long(self) -> dict[str, Any]:
        args = self.args
        stack, reused = self.stack_for(self.settings(), "long")
        self.warm_up(stack)
        vocab = self.vocab(stack)
        lengths = [self.rng.randint(args.prompt_min, args.prompt_max) for _ in range(args.requests)]
        prompts = [random_ids(self.rng, vocab, n) for n in lengths]
        before = preemptions(stack)
        poller = BlockPoller(stack, args.poll_interval)
        poller.start()
        print(
            f"[long] {args.requests} requests at once, prompts of {min(lengths)}-{max(lengths)} tokens "
            f"({sum(lengths)} in all), {args.output_len} output tokens each",
            flush=True,
        )
        try:
            results, wall = send(stack, prompts, args.output_len, args)
        finally:
            blocks = poller.stop()
        out = load_summary(results, wall) | {
            "max_model_len": _server_info(stack.address).get("max_model_len"),
            "stack_start_s": round(stack.start_s, 2),
            "reused_stack": reused,
            "preemptions": preemptions(stack) - before,
            "kv_blocks": blocks,
        }
        print(
            f"[long] {out['completed']} ok, {out['failed']} failed in {wall:.1f} s, {out['output_tokens_per_s']} "
            f"output tok/s; peak blocks target {blocks['target']['peak_blocks_used']}/{blocks['target']['num_blocks']}"
            f", draft {blocks['draft']['peak_blocks_used']}/{blocks['draft']['num_blocks']}; "
            f"{out['preemptions']:.0f} preemptions",
            flush=True,
        )
        return out

    def prefix(self) -> dict[str, Any]:
        args = self.args
        out: dict[str, Any] = {}
        rng = random.Random(args.seed + 1)  # the same prompts for both halves
        for caching in ("on", "off"):
            stack, reused = self.stack_for(self.settings(prefix=caching), f"prefix_{caching}")
            self.warm_up(stack)
            vocab = self.vocab(stack)
            rng.seed(args.seed + 1)
            shared = random_ids(rng, vocab, args.prefix_len)
            prompts = [
                shared + random_ids(rng, vocab, rng.randint(args.suffix_min, args.suffix_max))
                for _ in range(args.prefix_requests)
            ]
            results, wall = send(stack, prompts, args.ttft_output_len, args)
            summary = load_summary(results, wall) | {"stack_start_s": round(stack.start_s, 2), "reused_stack": reused}
            out[caching] = summary
            ttft = summary["ttft_ms"]
            print(
                f"[prefix] caching {caching}: TTFT p50 {ttft['p50']} ms, p90 {ttft['p90']} ms; "
                f"{summary['cached_prompt_tokens']} cached prompt tokens of {summary['prompt_tokens']}; "
                f"{summary['completed']} ok, {summary['failed']} failed",
                flush=True,
            )
            self.report["results"]["prefix"] = out
            self.save()
        return out

    def run(self, questions: list[str]) -> None:
        for name in questions:
            start = time.perf_counter()
            try:
                self.report["results"][name] = getattr(self, name)()
            except (RuntimeError, TimeoutError, ValueError, grpc.RpcError) as exc:
                detail = str(exc)
                if isinstance(exc, grpc.RpcError):
                    detail = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
                print(f"[{name}] failed: {detail}", flush=True)
                self.report["errors"][name] = detail[-4000:]
                self.stop()  # it may be broken: the next question starts its own
            self.report.setdefault("question_s", {})[name] = round(time.perf_counter() - start, 1)
            self.save()


def summary_lines(results: dict[str, Any]) -> list[str]:
    """One line per question, for the end of the run."""
    lines = []
    if "long" in results:
        r = results["long"]
        blocks = r["kv_blocks"]
        lines.append(
            f"summary long: {r['completed']} completed, {r['failed']} failed in {r['wall_s']} s, "
            f"{r['output_tokens_per_s']} output tok/s, TTFT p50 {r['ttft_ms']['p50']} ms; peak KV blocks target "
            f"{blocks['target']['peak_blocks_used']}/{blocks['target']['num_blocks']}, draft "
            f"{blocks['draft']['peak_blocks_used']}/{blocks['draft']['num_blocks']}; preemptions {r['preemptions']}"
        )
    if "connect" in results:
        side = ", ".join(f"max_model_len {k}: {v['connect_s']} s" for k, v in results["connect"].items())
        lines.append(f"summary connect (precapture on, start to SERVING): {side}")
    if "prefix" in results:
        for caching, r in results["prefix"].items():
            lines.append(
                f"summary prefix caching {caching}: TTFT p50 {r['ttft_ms']['p50']} ms, p90 {r['ttft_ms']['p90']} ms, "
                f"cached prompt tokens {r['cached_prompt_tokens']} of {r['prompt_tokens']}, "
                f"{r['completed']} completed, {r['failed']} failed"
            )
    if "first" in results:
        r = results["first"]
        lines.append(
            f"summary first: TTFT request 1 {r['ttft_first_ms']} ms, request {len(r['ttft_ms'])} "
            f"{r['ttft_last_ms']} ms (stack up in {r['stack_start_s']} s)"
        )
    return lines


# --------------------------------------------------------------------------------------------- main


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--questions", default=",".join(QUESTIONS), help="among long, connect, prefix, first")
    p.add_argument("--out", default="out/paged", help="directory for paged_bench.json and the services' logs")
    p.add_argument("--device", default="cuda", help="cuda, cuda:1 or cpu: both workers' device")
    p.add_argument("--target", help="target model directory (default: 8B-shaped random on CUDA, the demo on CPU)")
    p.add_argument("--draft", help="draft model directory (default: 68M-shaped random on CUDA, the demo on CPU)")
    p.add_argument("--checkpoint-dir", default="/tmp/minedraft-paged-ckpt", help="where shaped checkpoints are kept")
    p.add_argument("--mode", default="psd", choices=("psd", "sd", "ar"))
    p.add_argument("--max-batch-size", type=int, default=64, help="per batch (psd on one GPU: one batch of twice)")
    p.add_argument("--max-model-len", type=int, default=32768, help="of the long, prefix and first stacks")
    p.add_argument("--connect-lens", type=int_list, default=[2048, 32768], help="max_model_len of each connect stack")
    p.add_argument("--precapture-graphs", default="on", choices=("auto", "on", "off"), help="but connect: on")
    p.add_argument("--block-size", type=int)
    p.add_argument("--kv-cache-memory", type=float, help="GiB of KV cache for each worker")
    p.add_argument("--target-kv-cache-memory", type=float, help="GiB for the target (default on CUDA: 80)")
    p.add_argument("--draft-kv-cache-memory", type=float, help="GiB for the draft (default on CUDA: 12)")
    p.add_argument("--gpu-memory-utilization", type=float, help="where no KV cache memory is given")
    p.add_argument("--synthetic-acceptance", type=float, help="BENCHMARK ONLY: the target accepts drafts so")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the services (1 on a small CPU machine)")
    p.add_argument("--requests", type=int, default=128, help="long: requests sent at once")
    p.add_argument("--prompt-min", type=int, default=1000, help="long: shortest prompt, in tokens")
    p.add_argument("--prompt-max", type=int, default=4000, help="long: longest prompt, in tokens")
    p.add_argument("--output-len", type=int, default=512, help="long: tokens generated per request")
    p.add_argument("--prefix-requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=2000, help="prefix: the shared tokens")
    p.add_argument("--suffix-min", type=int, default=20, help="prefix: fewest own tokens after the shared ones")
    p.add_argument("--suffix-max", type=int, default=60, help="prefix: most own tokens after the shared ones")
    p.add_argument("--first-requests", type=int, default=10, help="first: requests one after the other")
    p.add_argument("--first-prompt-len", type=int, default=1000)
    p.add_argument("--ttft-output-len", type=int, default=16, help="tokens generated per prefix and first request")
    p.add_argument("--warmup", type=int, default=2, help="requests before the long and prefix loads on a new stack")
    p.add_argument("--poll-interval", type=float, default=0.2, help="seconds between the workers' /metrics scrapes")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, in seconds")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.questions = [q.strip() for q in args.questions.split(",") if q.strip()]
    unknown = sorted(set(args.questions) - set(QUESTIONS))
    if unknown:
        p.error(f"unknown question(s) {', '.join(unknown)}: choose among {', '.join(QUESTIONS)}")
    return args


def worker_kv(args: argparse.Namespace) -> dict[str, float | None]:
    """Each worker's --kv-cache-memory: see the module's docstring."""
    default = GPU_KV_GIB if args.device != "cpu" and args.gpu_memory_utilization is None else {}
    return {
        worker: next(
            (v for v in (getattr(args, f"{worker}_kv_cache_memory"), args.kv_cache_memory) if v is not None),
            default.get(worker),
        )
        for worker in WORKERS
    }


def stack_base(args: argparse.Namespace, target: str, draft: str) -> argparse.Namespace:
    """What every stack starts from: `minedraft bench` arguments, as `LocalStack` takes them."""
    line = ["bench", "--target", target, "--draft", draft, "--target-device", args.device]
    line += ["--draft-device", args.device, "--max-batch-size", str(args.max_batch_size)]
    line += ["--num-prompts", str(max(args.requests, args.prefix_requests, args.first_requests))]
    line += ["--num-warmup", str(args.warmup), "--timeout", str(args.timeout), "--seed", str(args.seed)]
    for name in ("block_size", "gpu_memory_utilization", "synthetic_acceptance", "threads"):
        if getattr(args, name) is not None:
            line += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    base = build_parser().parse_args(line)
    base.mode = args.mode
    base.worker_kv = worker_kv(args)  # appended per worker (Stack.start), not passed as the stack's one value
    return base


def main() -> int:
    # A shell that starts us in the background leaves SIGINT ignored; `timeout` sends SIGTERM: both stop the stack.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    args = parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    questions = [q for q in QUESTIONS if q in args.questions]
    start = time.perf_counter()
    bench: Bench | None = None
    try:
        target, draft = model_dirs(args)
        base = stack_base(args, target, draft)
        print(
            f"questions {', '.join(questions)} on {args.device}: target {target}, draft {draft}; KV cache GiB "
            f"{base.worker_kv}; logs in {out / 'logs'}",
            flush=True,
        )
        bench = Bench(args, base, out)
        bench.report["worker_kv_cache_memory_gib"] = base.worker_kv
        bench.save()
        bench.run(questions)
    except KeyboardInterrupt:
        print("interrupted: reporting what finished", flush=True)
        if bench is not None:
            bench.report["interrupted"] = True
    finally:
        if bench is not None:
            bench.stop()
            bench.report["total_s"] = round(time.perf_counter() - start, 1)
            bench.save()
    if bench is None:
        return 1
    for line in summary_lines(bench.report["results"]):
        print(line, flush=True)
    for name, error in bench.report["errors"].items():
        print(f"summary {name}: FAILED {error.splitlines()[0] if error else ''}", flush=True)
    print(f"total {time.perf_counter() - start:.0f} s; results in {out / 'paged_bench.json'}", flush=True)
    results = bench.report["results"]
    loads = [results.get("long", {}), results.get("first", {}), *results.get("prefix", {}).values()]
    failed = bench.report["errors"] or any(r.get("failed") for r in loads)
    return 1 if failed or bench.report["interrupted"] else 0


if __name__ == "__main__":
    sys.exit(main())
