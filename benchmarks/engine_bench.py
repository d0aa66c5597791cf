"""Engine-level CPU benchmark: speculative decoding against target-only AR, side by side in one run.

    python benchmarks/engine_bench.py                      # demo pair if shipped, else random tiny models
    python benchmarks/engine_bench.py --models minedraft/demo_models --k 4 --new-tokens 64 --repeats 3

Runs `minedraft_app.offline.generate_offline` (in-process continuous batching, greedy) at batch 1 and 8 for every
draft setting and for AR, alternating the modes within each repeat so that machine noise hits all of them alike,
and prints the median tokens/s, the SD/AR ratio and the mean accepted length (accepted drafts per verify step + 1).

Models: `--models DIR` with `target/` and `draft/` (by default the shipped demo pair when present, prompted with
Python source from the standard library, files it was not trained on first); otherwise random Llamas (target
hidden 256 x 4 layers, draft hidden 64 x 1 layer, vocab 1024; `--target-shape` / `--draft-shape`). Random
weights give an unrelated draft that is almost never accepted, so two more drafts bound the range: the target
drafting for itself (every draft accepted, but each draft costs a target forward) and, where the verifier supports
it, the small draft with the benchmark-only synthetic acceptance (NOT lossless; labelled). Lossless settings are
checked: their tokens must equal AR's.

Absolute numbers from a CPU say little about a GPU; the ratios measured side by side are the result.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import os
import platform
import shlex
import statistics
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

from draft_service.proposer import Proposer
from minedraft.engine.model_runner import ModelRunner
from minedraft.engine.models import load_model, load_tokenizer
from minedraft.engine.sampling import SamplingConfig
from minedraft_app.offline import OfflineRequest, OfflineResult, generate_offline
from target_service.verifier import Verifier

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_MODELS = REPO_ROOT / "minedraft" / "demo_models"


@dataclass
class DraftSetting:
    name: str
    model: PreTrainedModel | None  # None: AR
    synthetic_acceptance: float | None = None

    @property
    def lossless(self) -> bool:
        return self.synthetic_acceptance is None


@dataclass
class Measurement:
    setting: str
    batch: int
    tokens_per_s: list[float]
    mean_accepted_length: float
    lossless_ok: bool | None  # None: not checked (AR itself, or a synthetic setting)


def random_llama(hidden: int, layers: int, vocab: int, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        vocab_size=vocab,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def source_prompts(models: Path, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens from standard-library source, tokenized with the pair's tokenizer.

    Files are taken in order of the SHA-256 of their stdlib-relative path, the key `scripts/train_demo_pair.py`
    splits on (held-out = the lowest 5%), so the first prompts come from files the demo pair never trained on.
    """
    tokenizer = load_tokenizer(str(models / "target"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
    files = [p for p in stdlib.rglob("*.py") if not skip & set(p.relative_to(stdlib).parts)]

    def key(path: Path) -> bytes:
        return hashlib.sha256(path.relative_to(stdlib).as_posix().encode()).digest()[:8]

    prompts: list[list[int]] = []
    for path in sorted(files, key=key):
        ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 3 * length:
            start = len(ids) // 3
            prompts.append(ids[start : start + length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"found only {len(prompts)} stdlib files with {3 * length}+ tokens for {count} prompts")


def random_prompts(vocab: int, count: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def run_once(
    target: PreTrainedModel,
    setting: DraftSetting,
    prompts: list[list[int]],
    new_tokens: int,
    k: int,
    batch: int,
) -> tuple[float, list[OfflineResult]]:
    max_len = max(len(p) for p in prompts) + new_tokens + k + 2
    kwargs = {} if setting.synthetic_acceptance is None else {"synthetic_acceptance": setting.synthetic_acceptance}
    verifier = Verifier(ModelRunner(target, batch, max_len), [], **kwargs)
    proposer = None if setting.model is None else Proposer(ModelRunner(setting.model, batch, max_len))
    # Seeds only key the synthetic acceptance draws here (decoding is greedy): distinct per request.
    requests = [OfflineRequest(p, SamplingConfig(max_tokens=new_tokens, seed=i + 1)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    results = generate_offline(verifier, proposer, requests, k if proposer else 0, batch)
    elapsed = time.perf_counter() - start
    return sum(len(r.tokens) for r in results) / elapsed, results


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=Path, default=None, help="a directory with target/ and draft/")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests-per-batch", type=int, default=2, help="requests = this x batch size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--synthetic-acceptance", type=float, default=0.7, help="for random models only")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--target-shape",
        type=int,
        nargs=2,
        default=[256, 4],
        metavar=("HIDDEN", "LAYERS"),
        help="random target (without --models)",
    )
    parser.add_argument(
        "--draft-shape",
        type=int,
        nargs=2,
        default=[64, 1],
        metavar=("HIDDEN", "LAYERS"),
        help="random draft (without --models)",
    )
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)

    models = args.models
    if models is None and all((DEMO_MODELS / d / "model.safetensors").is_file() for d in ("target", "draft")):
        models = DEMO_MODELS
    count = max(args.batches) * args.requests_per_batch
    if models is not None:
        target = load_model(str(models / "target"), dtype="float32")
        draft = load_model(str(models / "draft"), dtype="float32")
        prompts = source_prompts(models, count, args.prompt_len)
        what = f"`{models}` (target {describe(target)}; draft {describe(draft)}), stdlib source prompts"
        settings = [DraftSetting("SD, demo draft", draft), DraftSetting("SD, target as its own draft", target)]
    else:
        vocab = 1024
        (target_hidden, target_layers), (draft_hidden, draft_layers) = args.target_shape, args.draft_shape
        target = random_llama(target_hidden, target_layers, vocab, 0)
        draft = random_llama(draft_hidden, draft_layers, vocab, 1)
        prompts = random_prompts(vocab, count, args.prompt_len)
        what = f"random weights: target {describe(target)}; draft {describe(draft)}; random prompts"
        settings = [
            DraftSetting("SD, unrelated small draft", draft),
            DraftSetting("SD, target as its own draft", target),
        ]
        if "synthetic_acceptance" in inspect.signature(Verifier).parameters:
            p = args.synthetic_acceptance
            settings.append(DraftSetting(f"SD, small draft, synthetic acceptance {p} (not lossless)", draft, p))
    ar = DraftSetting("AR (target only)", None)

    rows: list[Measurement] = []
    for batch in args.batches:
        batch_prompts = prompts[: batch * args.requests_per_batch]
        for setting in [ar, *settings]:  # warm-up: first-call allocations and kernel selection
            run_once(target, setting, batch_prompts[:batch], 8, args.k, batch)
        speeds: dict[str, list[float]] = {s.name: [] for s in [ar, *settings]}
        last: dict[str, list[OfflineResult]] = {}
        for _ in range(args.repeats):
            for setting in [ar, *settings]:
                speed, results = run_once(target, setting, batch_prompts, args.new_tokens, args.k, batch)
                speeds[setting.name].append(speed)
                last[setting.name] = results
        reference = [r.tokens for r in last[ar.name]]
        for setting in [ar, *settings]:
            results = last[setting.name]
            steps = sum(r.steps for r in results)
            accepted = sum(r.accepted for r in results)
            checked = None
            if setting.model is not None and setting.lossless:
                checked = [r.tokens for r in results] == reference
            mean_len = (accepted + steps) / steps if setting.model is not None and steps else 1.0
            rows.append(Measurement(setting.name, batch, speeds[setting.name], mean_len, checked))

    command = " ".join(["python", "benchmarks/engine_bench.py", *map(shlex.quote, sys.argv[1:])])
    print(f"command: {command}")
    print(f"date: {datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%d %H:%M UTC')}")
    print(f"machine: {machine()}")
    print(f"models: {what}")
    print(
        f"greedy, k = {args.k}, {args.new_tokens} new tokens per request, prompts of {args.prompt_len} tokens, "
        f"{args.requests_per_batch} x batch requests per run, median of {args.repeats} alternating repeats"
    )
    print()
    print("| batch | mode | tokens/s | SD/AR | mean accepted length | output equals AR |")
    print("|---:|---|---:|---:|---:|---|")
    for m in rows:
        ar_speed = statistics.median(next(r for r in rows if r.batch == m.batch and r.setting == ar.name).tokens_per_s)
        speed = statistics.median(m.tokens_per_s)
        check = {None: "n/a", True: "yes", False: "**NO**"}[m.lossless_ok]
        print(
            f"| {m.batch} | {m.setting} | {speed:.1f} | {speed / ar_speed:.2f} | {m.mean_accepted_length:.2f} | "
            f"{check} |"
        )
    if any(m.lossless_ok is False for m in rows):
        sys.exit("a lossless setting produced tokens different from AR")


def describe(model: PreTrainedModel) -> str:
    c = model.config
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return f"{c.model_type} hidden {c.hidden_size} x {c.num_hidden_layers} layers, vocab {c.vocab_size}, {params:.1f} M"


if __name__ == "__main__":
    main()
