"""Candidate tiles of `--deterministic`'s Triton matmul: whether each keeps rows bit-equal across M, and its time.

    python benchmarks/invariant_matmul_bench.py --device cuda:0

For each config of `CANDIDATES` (minedraft/kernels/batch_invariant.py `MatmulConfig`) and each 8B projection (K, N),
the rows of M = 1 ... 320 (and rows 100.. of a 5-row slice) must equal those of the M = 4096 product bit for bit; then
the time of the config against torch.mm (cuBLAS) at decode, verify and prefill sizes, and per config the sum over an
8B step's matmuls (32 layers of qkv, o, gate_up, down, then the LM head) at each M. `best` is the invariant config
with the least such time over M = 8, 40, 64, 320 (decodes and verifies at batch 8 and 64);
`benchmarks/deterministic_bench.py` runs the step times with it. On a CPU it runs under Triton's interpreter
(TRITON_INTERPRET=1), float32 and tiny shapes, as a check of the script.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, ".")
from minedraft.kernels.batch_invariant import CONFIG, MatmulConfig, matmul  # noqa: E402

# (name, K, N, per 8B step): the fused projections of an 8B Llama's 32 layers, then its LM head once
SHAPES_8B = [
    ("qkv", 4096, 6144, 32),
    ("o", 4096, 4096, 32),
    ("gate_up", 4096, 28672, 32),
    ("down", 14336, 4096, 32),
    ("lm_head", 4096, 128256, 1),
]
CHECK_MS = (1, 2, 5, 8, 16, 40, 64, 320, 4096)
TIME_MS = (8, 40, 64, 320, 4096)
PICK_MS = (8, 40, 64, 320)
# The tile (block_m, block_n, block_k) and warps fix each output's reduction; stages and programs per SM schedule.
# Narrow tiles give decodes more programs (no split-K: an N = 4096 projection has N / block_n tiles at M <= 64);
# wide ones spend less shared-memory bandwidth per MMA at verify and prefill sizes. The first of each block_k is
# the one the others' bits are compared with.
CANDIDATES = [
    CONFIG,
    MatmulConfig(64, 64, 64, 4, 4, 2),
    MatmulConfig(64, 32, 64, 4, 6, 2),
    MatmulConfig(64, 128, 64, 4, 4, 2),
    MatmulConfig(128, 64, 64, 4, 4, 2),
    MatmulConfig(128, 128, 64, 8, 3, 2),
    MatmulConfig(64, 64, 128, 4, 3, 2),
    MatmulConfig(64, 32, 128, 4, 4, 2),
    MatmulConfig(64, 16, 128, 4, 5, 2),
    MatmulConfig(32, 32, 128, 4, 4, 2),
]


def timer(device: str) -> Callable[[Callable[[], object], int], float]:
    """A function giving the mean microseconds of `fn()` over `iters` calls after two warm-up calls."""

    def measure(fn: Callable[[], object], iters: int) -> float:
        fn()
        fn()
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / iters
        began = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - began) * 1e6 / iters

    return measure


def invariant(
    config: MatmulConfig, x: torch.Tensor, w: torch.Tensor, ms: tuple[int, ...]
) -> tuple[list[int], torch.Tensor]:
    """(the M's whose rows differ from those of the largest M, -5 where rows 100..104 alone do; that product)."""
    full = matmul(x, w.t(), config)
    bad = [m for m in ms if not torch.equal(matmul(x[:m], w.t(), config), full[:m])]
    if x.shape[0] > 105 and not torch.equal(matmul(x[100:105], w.t(), config), full[100:105]):
        bad.append(-5)
    return bad, full


def sweep(
    device: str,
    dtype: torch.dtype,
    shapes: list[tuple[str, int, int, int]],
    check_ms: tuple[int, ...],
    time_ms: tuple[int, ...],
    candidates: list[MatmulConfig],
    iters: int,
) -> MatmulConfig | None:
    """Prints each candidate's invariance and times (module docstring), and whether its bits equal those of the
    first candidate of its block_k (if so on every shape, configs could differ by M); returns the invariant one
    whose 8B step's matmuls are slowest against torch.mm's by the least factor over `PICK_MS`."""
    measure = timer(device)
    generator = torch.Generator().manual_seed(0)
    operands = {}
    for name, k, n, _ in shapes:
        w = (torch.randn(n, k, generator=generator) / k**0.5).to(device, dtype)
        operands[name] = (torch.randn(max(check_ms), k, generator=generator).to(device, dtype), w)
    baseline: dict[tuple[str, int], float] = {}
    for name, _, _, _ in shapes:
        x, w = operands[name]
        for m in time_ms:
            baseline[name, m] = measure(functools.partial(torch.mm, x[:m], w.t()), iters if m < 1024 else 3)
    torch_step = {m: sum(baseline[s[0], m] * s[3] for s in shapes) for m in time_ms}
    picked = [m for m in time_ms if m in PICK_MS] or list(time_ms)
    print(f"matmul configs on {where(device)}, {dtype}: us per call (torch.mm's in brackets); invariant: rows equal")
    print("across M; same: bits equal to the first config of its block_k; step ms: an 8B step's matmuls")
    print(f"{'config':>24} {'shape':>8} {'invariant':>9} {'same':>5} " + " ".join(f"{f'M={m}':>16}" for m in time_ms))
    ranked: list[tuple[float, MatmulConfig]] = []
    firsts: dict[int, dict[str, torch.Tensor]] = {}
    for config in candidates:
        per_step = dict.fromkeys(time_ms, 0.0)
        all_equal = all_same = True
        first = firsts.setdefault(config.block_k, {})
        for name, _, _, count in shapes:
            x, w = operands[name]
            try:
                bad, full = invariant(config, x, w, check_ms)
                times = {
                    m: measure(functools.partial(matmul, x[:m], w.t(), config), iters if m < 1024 else 3)
                    for m in time_ms
                }
            except Exception as exc:  # (a tile past the GPU's shared memory: Triton's OutOfResources)
                print(f"{config!s:>24} {name:>8} error: {type(exc).__name__}: {str(exc)[:80]}")
                all_equal = False
                break
            same = torch.equal(first.setdefault(name, full), full)
            del full
            all_equal, all_same = all_equal and not bad, all_same and same
            for m in time_ms:
                per_step[m] += times[m] * count
            cells = " ".join(f"{f'{times[m]:.1f} ({baseline[name, m]:.1f})':>16}" for m in time_ms)
            verdict = f"{'yes' if not bad else f'NO {bad}':>9} {'yes' if same else 'no':>5}"
            print(f"{config!s:>24} {name:>8} {verdict} {cells}")
        else:
            cells = " ".join(f"{f'{per_step[m] / 1e3:.2f} ({torch_step[m] / 1e3:.2f})':>16}" for m in time_ms)
            verdict = f"{'yes' if all_equal else 'NO':>9} {'yes' if all_same else 'no':>5}"
            print(f"{config!s:>24} {'step ms':>8} {verdict} {cells}")
            if all_equal:
                ranked.append((max(per_step[m] / torch_step[m] for m in picked), config))
    best = min(ranked, key=lambda item: item[0]) if ranked else None
    if best is None:
        print("no config kept rows bit-equal across M")
        return None
    print(f"best invariant config: {best[1]} (its step's matmuls at most {best[0]:.2f}x torch.mm's at M in {picked})")
    return best[1]


def where(device: str) -> str:
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu (Triton interpreter)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    run(args.device, args.iters)


def run(device: str, iters: int) -> MatmulConfig | None:
    """The sweep at the 8B shapes on a GPU; on a CPU (under the interpreter) at a tiny shape, float32."""
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        return sweep(device, torch.bfloat16, SHAPES_8B, CHECK_MS, TIME_MS, CANDIDATES, iters)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("matmul configs: on a CPU only under Triton's interpreter (TRITON_INTERPRET=1); skipped")
        return None
    tiny = [("tiny", 96, 80, 1)]
    return sweep(device, torch.float32, tiny, (1, 5, 70, 130), (5, 130), CANDIDATES[:3], 1)


if __name__ == "__main__":
    main()
