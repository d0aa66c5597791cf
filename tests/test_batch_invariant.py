"""`--deterministic` on a CPU in bfloat16: each op's row, and a runner's logits, alike whatever else the step holds."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

from minedraft.engine.batch_invariant import (
    KEY_SPLIT,
    InvariantMode,
    fixed_split_attention,
    invariant_bmm,
    invariant_mm,
)
from minedraft.engine.model_runner import ModelRunner

# torch's default threads (the session runs on one): with one, oneDNN's bf16 rows do not depend on M here.
pytestmark = pytest.mark.usefixtures("default_threads")

# Wide enough that oneDNN's bf16 blocking changes with M (at 64 x 128 it does not).
K, N = 1024, 4096
MS = (1, 2, 5, 16, 17, 40)  # decode, verify, batch sizes around the row chunk


def _rows_equal(fn: object, x: torch.Tensor, w: torch.Tensor) -> list[int]:
    """The M of `MS` whose rows differ from the same rows computed in one call of 80 rows."""
    full = fn(x, w)  # type: ignore[operator]
    return [m for m in MS if not torch.equal(fn(x[:m], w), full[:m])]  # type: ignore[operator]


def _operands() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(K, N, generator=generator).bfloat16()
    return torch.randn(80, K, generator=generator).bfloat16(), w


@functools.cache
def cpu_matmul_depends_on_m() -> bool:
    """Whether this CPU's bf16 matmul gives a row other bits at another M: oneDNN's kernels for CPUs with AVX-512 BF16
    (AMD EPYC here) do not at these shapes, its AVX2 and AVX-512F ones do."""
    return bool(_rows_equal(torch.mm, *_operands()))


def test_cpu_bf16_matmul_rows_depend_on_m_unless_invariant() -> None:
    x, w = _operands()
    print(f"torch's bf16 matmul depends on M on this CPU: {cpu_matmul_depends_on_m()}")
    assert _rows_equal(invariant_mm, x, w) == []
    # A row alone, or at another place among others, or after other rows in the same chunk.
    full = invariant_mm(x, w)
    assert torch.equal(invariant_mm(x[7:8], w), full[7:8])
    assert torch.equal(invariant_mm(x[3:20], w)[4:5], full[7:8])
    torch.testing.assert_close(full.float(), (x.double() @ w.double()).float(), rtol=2e-2, atol=0.5)
    start = time.perf_counter()
    for _ in range(5):
        invariant_mm(x[:1], w)
    chunked = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(5):
        torch.mm(x[:1], w)
    print(f"M=1 {K}x{N}: invariant {chunked / 5 * 1e3:.2f} ms, plain {(time.perf_counter() - start) / 5 * 1e3:.2f}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bmm_rows_and_entries_independent(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(6, 40, 128, generator=generator).to(dtype)
    b = torch.randn(6, 128, KEY_SPLIT, generator=generator).to(dtype)
    full = invariant_bmm(a, b)
    for entries, rows in ((1, 1), (2, 5), (6, 17)):
        assert torch.equal(invariant_bmm(a[:entries, :rows], b[:entries]), full[:entries, :rows])
    assert torch.equal(invariant_bmm(a[3:5, 2:3], b[3:5]), full[3:5, 2:3])


def _attention_inputs(batch: int, n: int, length: int, seed: int = 2) -> tuple[torch.Tensor, ...]:
    """Queries of `n` new tokens at the end of rows of `length` keys (GQA, 2 query heads per K/V head), gathered
    K/V padded to a multiple of 64 with garbage, and the additive causal mask."""
    generator = torch.Generator().manual_seed(seed)
    padded = -(-length // 64) * 64 + 64
    query = torch.randn(batch, 4, n, 32, generator=generator).bfloat16()
    key = torch.randn(batch, 2, padded, 32, generator=generator).bfloat16()
    value = torch.randn(batch, 2, padded, 32, generator=generator).bfloat16()
    positions = length - n + torch.arange(n)
    seen = torch.arange(padded)[None, :] <= positions[:, None]
    mask = torch.zeros(batch, 1, n, padded, dtype=torch.bfloat16)
    mask.masked_fill_(~seen, torch.finfo(torch.bfloat16).min)
    return query, key, value, mask


def test_fixed_split_attention_row_independent_of_query_count_and_key_length() -> None:
    """The last of 5 verify queries equals the same query as a one-token decode, over a longer gather, in another
    batch; and the result is attention's."""
    query, key, value, mask = _attention_inputs(3, 5, 150)
    verify = fixed_split_attention(query, key, value, mask, 0.2)  # [B, n, heads, D]
    decode = fixed_split_attention(query[:, :, 4:], key[:, :, :192], value[:, :, :192], mask[:, :, 4:, :192], 0.2)
    assert torch.equal(verify[:, 4:], decode)
    alone = fixed_split_attention(query[1:2, :, 2:3], key[1:2], value[1:2], mask[1:2, :, 2:3], 0.2)
    assert torch.equal(alone, verify[1:2, 2:3])
    want = torch.softmax(
        (query.double() @ key.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.2 + mask.double(), -1
    ) @ value.double().repeat_interleave(2, 1)
    torch.testing.assert_close(verify.double(), want.transpose(1, 2), rtol=2e-2, atol=2e-2)


def test_row_mean_and_norm_rows_alike_under_the_mode() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 2048, generator=generator).bfloat16()
    norm = torch.nn.RMSNorm(2048, eps=1e-6).bfloat16()
    with InvariantMode(), torch.inference_mode():
        full = norm(x)
        assert all(torch.equal(norm(x[:m]), full[:m]) for m in MS)
        assert torch.equal(x.float().pow(2).mean(-1, keepdim=True)[:1], x[:1].float().pow(2).mean(-1, keepdim=True))


def logits_by_step(
    deterministic: bool, arch: str = "llama", device: str = "cpu", hidden: int = 512
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits of 5 positions after one prompt: decoded one token a step beside 2 other rows, verified as one
    5-token step alone, and prefilled with the prompt (the last position); bf16 `arch` of `hidden` x 2 layers."""
    window = {"sliding_window": 8} if arch == "mistral" else {}  # windows shorter than the prompt
    model = build_tiny_model(arch, 0, hidden=hidden, layers=2, vocab=512, heads=8, kv_heads=2, **window).bfloat16()
    model.to(device)  # type: ignore[arg-type]
    runner = ModelRunner(model, 8, 128, kv_cache_memory=0.05, deterministic=deterministic)
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 512, (1, 21), generator=generator)
    follow = torch.randint(0, 512, (1, 5), generator=generator)
    others = torch.randint(0, 512, (2, 30), generator=generator)
    rows = runner.allocate(4)
    decode_rows = torch.tensor(rows[:3])
    runner.forward(decode_rows, torch.cat([torch.cat([prompt, prompt[:, :9]], 1), others]), torch.tensor([21, 30, 30]))
    decoded = []
    for i in range(5):
        step = torch.cat([follow[:, i : i + 1], others[:, i : i + 1]])
        decoded.append(runner.forward(decode_rows, step, torch.ones(3, dtype=torch.long))[0, 0].clone())
    verify_row = torch.tensor(rows[3:])
    runner.forward(verify_row, prompt, torch.tensor([21]))
    verified = runner.forward(verify_row, follow, torch.tensor([5]))[0].clone()
    runner.release(rows)
    whole = torch.cat([prompt, follow], 1)
    (row,) = runner.allocate(1)
    prefilled = runner.forward(torch.tensor([row]), whole, torch.tensor([26]))[0, -1]
    return torch.stack(decoded), verified, prefilled


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_runner_logits_alike_in_decode_verify_and_prefill(arch: str) -> None:
    """A bf16 model of hidden 512: without the flag a position's logits differ between a decode beside other rows
    and a 5-token verify (what made ar, sd and psd disagree); with it they are bit-identical, and equal the
    prompt's prefill too (Qwen3: its per-head norms; Mistral: a sliding window of 8; the plain path is shown on
    Llama only, to save time)."""
    if arch == "llama" and cpu_matmul_depends_on_m():  # (else the plain path is invariant here too)
        decoded, verified, _ = logits_by_step(False, arch)
        assert not torch.equal(decoded, verified), "the plain path gave equal bits: the test would not see a change"
    decoded, verified, prefilled = logits_by_step(True, arch)
    assert torch.equal(decoded, verified)
    assert torch.equal(verified[-1], prefilled)


_RANK = """
import sys, torch, torch.distributed as dist
from minedraft.engine.tensor_parallel import ordered_all_reduce
rank, size, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=size)
x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank)).bfloat16()
result = {}
for name, reduce in (("plain", dist.all_reduce), ("ordered", ordered_all_reduce)):
    sums = {}
    for m in (1, 5, 64):
        y = x[:m].clone()
        reduce(y)
        sums[m] = y
    result[name] = [m for m in (1, 5) if not torch.equal(sums[m][0], sums[64][0])]
if rank == 0:
    torch.save(result, out)
dist.destroy_process_group()
"""


def test_gloo_all_reduce_rows_depend_on_size_unless_ordered(tmp_path: Path) -> None:
    """Three gloo ranks: a row's all-reduced sum differs between buffers of 1, 5 and 64 rows (the ring's chunks
    follow the size); `ordered_all_reduce`, what `--deterministic` runs with three ranks or more, keeps it."""
    out = tmp_path / "result.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    ranks = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(r), "3", str(tmp_path / "rendezvous"), str(out)], env=env)
        for r in range(3)
    ]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0, 0]
    result = torch.load(out)
    assert result["plain"], "gloo summed every row alike: the test would not see a change"
    assert result["ordered"] == []
