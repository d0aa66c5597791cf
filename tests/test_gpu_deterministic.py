"""`--deterministic` on CUDA: the Triton kernels' rows alike whatever the step, and ar, sd, psd bit-identical in bf16.

The kernels' logic also runs on the CPU through Triton's interpreter (float32). On a GPU:

    python -m pytest -q -x tests/test_gpu_deterministic.py
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (K, N) of an 8B target's projections and a 1B draft's, and M of decodes, verifies and batches around the tiles
SHAPES = [(4096, 6144), (4096, 28672), (14336, 4096), (2048, 3072)]
MS = (1, 2, 5, 8, 40, 129, 320)


def check_matmul(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]], ms: tuple[int, ...]) -> None:
    """The Triton matmul's rows are bit-equal whatever M and wherever the row sits, and close to float64."""
    from minedraft.kernels.batch_invariant import matmul

    generator = torch.Generator().manual_seed(0)
    for k, n in shapes:
        w = torch.randn(n, k, generator=generator).to(device, dtype) / k**0.5
        x = torch.randn(max(ms), k, generator=generator).to(device, dtype)
        full = matmul(x, w.t())
        for m in ms:
            assert torch.equal(matmul(x[:m], w.t()), full[:m]), (k, n, m)
        assert torch.equal(matmul(x[3:4], w.t()), full[3:4])
        want = x.double() @ w.double().t()
        error = ((full.double() - want).norm() / want.norm()).item()
        assert error < (1e-5 if dtype == torch.float32 else 1e-2), (k, n, error)


def check_bmm(device: str, dtype: torch.dtype, k: int, n: int, ms: tuple[int, ...]) -> None:
    """The batched matmul's entries are bit-equal to the lone matmul of each, whatever M and E, with strided and
    broadcast (stride 0) operands as attention's gathered K/V give them."""
    from minedraft.kernels.batch_invariant import bmm, matmul

    generator = torch.Generator().manual_seed(3)
    w = torch.randn(5, n, k, generator=generator).to(device, dtype) / k**0.5
    x = torch.randn(5, max(ms), k, generator=generator).to(device, dtype)
    full = bmm(x, w.transpose(1, 2))
    for e in range(5):
        assert torch.equal(full[e], matmul(x[e], w[e].t())), e
    for m in ms:
        assert torch.equal(bmm(x[1:3, :m], w[1:3].transpose(1, 2)), full[1:3, :m]), m
    shared = bmm(x, w[:1].transpose(1, 2).expand(5, k, n))
    assert all(torch.equal(shared[e], matmul(x[e], w[0].t())) for e in range(5))


def check_row_mean(device: str) -> None:
    from minedraft.kernels.batch_invariant import row_mean

    x = torch.randn(70, 4096, generator=torch.Generator().manual_seed(1)).to(device)
    full = row_mean(x)
    assert all(torch.equal(row_mean(x[:m]), full[:m]) for m in (1, 2, 5, 33))
    torch.testing.assert_close(full, x.mean(-1, keepdim=True))


def check_rms_norm(device: str, dtype: torch.dtype) -> None:
    """The one-kernel RMSNorm's rows are bit-equal whatever the rows, and equal Llama's norm to rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from minedraft.kernels.batch_invariant import rms_norm

    generator = torch.Generator().manual_seed(4)
    for width in (4096, 128, 300):
        x = torch.randn(70, width, generator=generator).to(device, dtype) * 3
        norm = LlamaRMSNorm(width, eps=1e-5).to(device, dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(width, generator=generator) + 0.5)
            full = rms_norm(x, norm.weight, 1e-5)
            assert all(torch.equal(rms_norm(x[:m], norm.weight, 1e-5), full[:m]) for m in (1, 2, 5, 33)), width
            assert torch.equal(rms_norm(x[None, 3:9], norm.weight, 1e-5)[0], full[3:9])
            tolerance = (None, None) if dtype == torch.float32 else (0.01, 0.02)
            torch.testing.assert_close(full, norm(x), rtol=tolerance[0], atol=tolerance[1])


def _fixed_attention(inputs: Any, scale: float, window: int, batch: slice, queries: slice) -> torch.Tensor:
    """The fixed paged attention of `inputs` (`test_decode_attention.Inputs`) for some entries and queries."""
    from minedraft.kernels.decode_attention import paged_attention

    return paged_attention(
        inputs.query[batch, :, queries],
        inputs.key_cache,
        inputs.value_cache,
        inputs.block_tables,
        inputs.rows[batch],
        inputs.positions[batch, queries].contiguous(),
        scale,
        window,
        fixed=True,
    )


def check_fixed_attention(device: str, dtype: torch.dtype) -> None:
    """The fixed paged attention equals float64 attention, and each query's output is bit-equal whether it comes as
    one of a verify's 5 queries, as a one-query decode, or with other rows in the batch (windows too)."""
    from test_decode_attention import Case, paged_inputs, reference

    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    # (the last: a prefill's many queries, entry 0 a fresh prompt's, over several blocks of folded queries)
    cases = [
        Case(4, 8, 2, 5, 32, 300, 16, 0, None, 64),
        Case(3, 12, 2, 5, 64, 260, 16, 40, None, 64),
        Case(3, 8, 2, 70, 64, 300, 16, 0, None, 64),
    ]
    if device == "cpu":  # (the interpreter: fewer and shorter rows)
        cases = [
            Case(3, 4, 2, 4, 32, 140, 16, 0, None, 64),
            Case(3, 4, 2, 4, 16, 150, 16, 40, None, 64),
            Case(2, 4, 2, 24, 16, 90, 16, 0, None, 64),
        ]
    for case in cases:
        inputs = paged_inputs(case, device, dtype, generator)
        scale = case.dim**-0.5
        attend = functools.partial(_fixed_attention, inputs, scale, case.window)
        full = attend(slice(None), slice(None))
        expected = reference(inputs, scale, case.window)
        error = ((full.cpu().double() - expected).norm() / expected.norm()).item()
        assert error < (1e-5 if dtype == torch.float32 else 2e-2), (case, error)
        for i in range(case.n):
            assert torch.equal(attend(slice(None), slice(i, i + 1)), full[:, i : i + 1]), (case, i)
        assert torch.equal(attend(slice(1, 3), slice(2, 5)), full[1:3, 2:5]), case


def check_all(device: str, dtype: torch.dtype) -> None:
    cpu = device == "cpu"  # (the interpreter: small shapes, K a multiple of the tile's and not)
    check_matmul(device, dtype, [(96, 160), (128, 80)] if cpu else SHAPES, (1, 5, 130) if cpu else MS)
    check_bmm(device, dtype, *((96, 80, (1, 5, 70)) if device == "cpu" else (128, 576, (1, 5, 64, 129))))
    check_row_mean(device)
    check_rms_norm(device, dtype)
    check_fixed_attention(device, dtype)


@needs_interpreter
def test_kernels_rows_alike_in_triton_interpreter() -> None:
    run_in_interpreter("test_gpu_deterministic", "t.check_all('cpu', torch.float32)")


@needs_gpu
def test_kernels_rows_alike_on_a_gpu() -> None:
    check_all("cuda", torch.bfloat16)
    check_all("cuda", torch.float32)


@needs_gpu
def test_fused_norms_only_inside_the_mode() -> None:
    """`fuse_norms` gives Llama's norms the one kernel inside an `InvariantMode`; outside it they compute
    as transformers does, and Gemma 3's (1 + weight) norm is left alone."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from minedraft.engine.batch_invariant import InvariantMode, fuse_norms
    from minedraft.kernels.batch_invariant import rms_norm

    small: dict[str, Any] = dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, vocab_size=100
    )
    with torch.device("cuda"):
        llama = LlamaForCausalLM(LlamaConfig(**small)).bfloat16()
        gemma = Gemma3ForCausalLM(Gemma3TextConfig(**small, head_dim=64)).bfloat16()
    assert fuse_norms(llama) == 2 * 2 + 1 and fuse_norms(gemma) == 0
    norm = llama.model.norm
    x = torch.randn(7, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(norm(x), type(norm).forward(norm, x))
        with InvariantMode():
            inside = norm(x)
        assert torch.equal(inside, rms_norm(x, norm.weight, norm.variance_epsilon))


@needs_gpu
def test_cublas_rows_depend_on_m() -> None:
    """What the flag is for: cuBLAS's bf16 rows of an 8B projection differ with M somewhere among decode and verify
    sizes (if this fails, the GPU's cuBLAS happened to be invariant at these shapes)."""
    generator = torch.Generator().manual_seed(2)
    differ = []
    for k, n in SHAPES:
        w = torch.randn(n, k, generator=generator).to("cuda", torch.bfloat16)
        x = torch.randn(max(MS), k, generator=generator).to("cuda", torch.bfloat16)
        full = x @ w.t()
        differ += [(k, n, m) for m in MS if not torch.equal(x[:m] @ w.t(), full[:m])]
    assert differ


@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_runner_logits_alike_on_a_gpu(arch: str) -> None:
    """On the runner, with CUDA graphs: a position's bf16 logits as decodes beside other rows, in one verify and at
    the end of a prefill are bit-equal with the flag (without it, printed: whether they differ at hidden 2048)."""
    from test_batch_invariant import logits_by_step

    decoded, verified, _ = logits_by_step(False, arch, "cuda", hidden=2048)
    print(f"{arch} without --deterministic: decode and verify logits bit-equal: {torch.equal(decoded, verified)}")
    decoded, verified, prefilled = logits_by_step(True, arch, "cuda", hidden=2048)
    assert torch.equal(decoded, verified)
    assert torch.equal(verified[-1], prefilled)


@needs_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_modes_bit_identical_through_the_services_on_a_gpu(arch: str, tmp_path: Path) -> None:
    """Random bf16 weights (a target of hidden 2048 x 4 layers, GQA 16/4; Gemma 3 with sliding windows of 32 between
    full layers), target and draft on the GPU with CUDA graphs and `--deterministic`: 16 staggered requests of 48
    tokens give the same tokens in ar, sd, psd and each alone (the 4 seeded sampled ones in sd, psd and alone)."""
    from stack import TinyPairs, start_workers
    from test_stack_deterministic import check_modes_agree, make_wide_pair, requests_of

    pairs = TinyPairs(tmp_path)
    pair = make_wide_pair(tmp_path, arch, pairs.tokenizer, hidden=2048, layers=4, heads=16, kv_heads=4)
    logs = tmp_path / "logs"
    logs.mkdir()
    flags = ["--dtype", "bfloat16", "--deterministic", "--kv-cache-memory", "1"]
    workers = start_workers(pair, logs, target_device="cuda", draft_device="cuda", extra=flags)
    try:
        check_modes_agree(workers, requests_of(pairs.tokenizer, seed=12, tokens=48))
    finally:
        workers.stop()
