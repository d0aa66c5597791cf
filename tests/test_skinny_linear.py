"""The few-row linear kernel equals float64 products: on the CPU through Triton's interpreter, and on GPUs; with it
on, the fused Llama modules give the same steps as with cuBLAS."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

pytest.importorskip("triton", reason="Triton is not installed")

ROWS = [1, 5, 16, 33, 80, 128]  # a decode, a verify of 4 drafts, batches of them; each row tile and K step
# (output columns, K, bias): a column count that no program tile divides, a K of one loop step and of several
SHAPES = [(48, 256, False), (100, 512, True), (64, 768, False)]


def check_against_reference(device: str, dtype: torch.dtype, tolerance: float) -> None:
    from minedraft import skinny_linear

    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for rows, (n_out, k_in, with_bias) in itertools.product(ROWS, SHAPES):

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device, dtype)

        # Rows as a step's hidden states are: [B, n, K], here a view with a row stride wider than K.
        x = randn(rows, k_in + 32)[:, :k_in].reshape(rows, 1, k_in)
        weight, bias = randn(n_out, k_in), randn(n_out) if with_bias else None
        assert skinny_linear.supports(x, weight), (rows, n_out, k_in)
        out = skinny_linear.skinny_linear(x, weight, bias)
        expected = torch.nn.functional.linear(x.cpu().double(), weight.cpu().double(),
                                              None if bias is None else bias.cpu().double())
        assert out.shape == (rows, 1, n_out) and out.dtype == dtype
        error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
        assert error < tolerance, f"relative error {error:.2e} for rows={rows}, {n_out} x {k_in}"
    # More rows than a step has, or a K the loop step does not divide: not the kernel's (cuBLAS's, in the operator).
    assert not skinny_linear.supports(randn(skinny_linear.MAX_ROWS + 1, 256), randn(64, 256))
    assert not skinny_linear.supports(randn(4, 200), randn(64, 200))
    assert not skinny_linear.supports(randn(4, 256), randn(64, 512))  # mismatched K: F.linear's error, not garbage


def check_the_operator_in_compiled_code(device: str) -> None:
    """Compiled code calls the operator as it is (its fake gives the output's shape): few rows take the kernel, more
    rows cuBLAS, both equal to the product."""
    from minedraft import skinny_linear

    def layer(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return torch.ops.minedraft.linear(x * 2, weight, bias).relu()

    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    weight, bias = torch.randn(96, 256, device=device), torch.randn(96, device=device)
    for rows in (5, skinny_linear.MAX_ROWS + 3):
        x = torch.randn(2, rows, 256, device=device)
        torch.testing.assert_close(compiled(x, weight, bias), layer(x, weight, bias))
        torch.testing.assert_close(compiled(x, weight, bias), torch.nn.functional.linear(x * 2, weight, bias).relu(),
                                   atol=1e-4, rtol=1e-4)


@needs_interpreter
def test_the_kernel_equals_float64_products_in_triton_interpreter() -> None:
    run_in_interpreter("test_skinny_linear", "t.check_against_reference('cpu', torch.float32, 1e-5); "
                       "t.check_the_operator_in_compiled_code('cpu')")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_equals_float64_products_on_a_gpu() -> None:
    check_against_reference("cuda", torch.bfloat16, 1e-2)
    check_the_operator_in_compiled_code("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_steps_with_the_kernel_equal_steps_with_cublas() -> None:
    """A Llama-shaped model's prefill, verify-sized and one-token steps through `ModelRunner`, float32, CUDA graphs:
    the kernel (ENABLED) against cuBLAS; the prefill's rows exceed MAX_ROWS and go to cuBLAS inside the operator."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from minedraft import skinny_linear
    from minedraft.model_runner import BATCH_BUCKETS, ModelRunner

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to("cuda").eval()

    plain, calls = skinny_linear.skinny_linear, []

    def counted(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(x.numel() // x.shape[-1])
        return plain(x, weight, bias)

    def steps(enabled: bool) -> list[torch.Tensor]:
        skinny_linear.ENABLED = enabled
        skinny_linear.skinny_linear = counted  # type: ignore[assignment]
        try:
            runner = ModelRunner(model, 4, 256)
            rows = torch.tensor(runner.allocate(3))
            generator = torch.Generator().manual_seed(1)
            out = [runner.forward(rows, torch.randint(0, 512, (3, 60), generator=generator), torch.full((3,), 60),
                                  last_only=True).cpu()]
            for n in (5, 1, 5):
                ids = torch.randint(0, 512, (3, n), generator=generator)
                out.append(runner.forward(rows, ids, torch.full((3,), n)).cpu())  # copied at once (graph buffers)
            return out
        finally:
            skinny_linear.ENABLED = False
            skinny_linear.skinny_linear = plain  # type: ignore[assignment]

    with_kernel = steps(True)
    # Every projection of the verify-sized and one-token steps (their 3 rows padded to a batch bucket), none of the
    # prefill's (60 tokens a row: too many rows).
    padded = next(b for b in BATCH_BUCKETS if b >= 3)
    assert calls and set(calls) == {5 * padded, padded}, calls
    calls.clear()
    for kernel, cublas in zip(with_kernel, steps(False), strict=True):
        torch.testing.assert_close(kernel, cublas, atol=1e-3, rtol=1e-3)
    assert not calls


if __name__ == "__main__":  # the GPU machine may lack pytest's plugins: `python tests/test_skinny_linear.py`
    test_the_kernel_equals_float64_products_on_a_gpu()
    test_steps_with_the_kernel_equal_steps_with_cublas()
    print("the few-row linear kernel equals float64 products and cuBLAS steps")
