"""The Triton short-query attention equals float64 attention: on the CPU through Triton's interpreter, and on GPUs."""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest
import torch
from interpreter import needs_interpreter, run_in_interpreter

triton = pytest.importorskip("triton", reason="Triton is not installed")

# (batch, heads, kv_heads, new tokens, head dim, keys, chunks, keys per tile): GQA verify and decode shapes, no GQA,
# one chunk, several, more chunks than tiles; both tiles that steps choose between (`decode_attention.tiles`); K/V
# always views of a larger cache.
SHAPES = [
    (2, 8, 2, 5, 32, 200, None, 64),
    (3, 8, 2, 5, 32, 300, 3, 128),
    (1, 4, 1, 1, 16, 130, 1, 128),
    (4, 4, 4, 1, 16, 70, 8, 64),
    (2, 12, 2, 3, 64, 260, 2, 128),
]


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    groups = query.shape[1] // key.shape[1]
    k, v = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    scores = query.double() @ k.transpose(-1, -2) * scale + mask.double()
    return (scores.softmax(-1) @ v).transpose(1, 2)


def check_against_reference(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """Random inputs for each of SHAPES: each row's last `n` positions are its queries, causal over its own length, so
    whole key tiles are masked off and lengths differ between rows. Given the positions, the kernels must not read
    past them: the cache holds NaN there, as a rolled-back row's garbage might."""
    from minedraft.kernels import decode_attention
    from minedraft.kernels.decode_attention import short_query_attention

    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    inputs = ("mask only", "positions", "positions, no mask")
    for (batch, heads, kv_heads, n, dim, keys, chunks, block_keys), passed in itertools.product(SHAPES, inputs):
        given = passed != "mask only"

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device, dtype)

        # As the projections leave it ([B, n, heads, D] transposed), or contiguous.
        query = randn(batch, n, heads, dim).transpose(1, 2) if n > 1 else randn(batch, heads, n, dim)
        cache_k, cache_v = randn(batch + 2, kv_heads, keys + 40, dim), randn(batch + 2, kv_heads, keys + 40, dim)
        lengths = torch.randint(n, keys + 1, (batch,), generator=generator)
        lengths[0] = n  # one row with only its own new tokens: every later tile masked off
        if given:
            for row, length in enumerate(lengths.tolist()):
                cache_k[row + 1, :, length:] = cache_v[row + 1, :, length:] = float("nan")
        key, value = cache_k[1 : batch + 1, :, :keys], cache_v[1 : batch + 1, :, :keys]  # strided views, as the cache's
        positions = lengths[:, None] - n + torch.arange(n)
        allowed = torch.arange(keys)[None, None, :] <= positions[:, :, None]
        mask = torch.zeros(batch, 1, n, keys).masked_fill_(~allowed[:, None], torch.finfo(dtype).min).to(device, dtype)
        scale = dim**-0.5

        decode_attention.BLOCK_KEYS = block_keys
        try:
            out = short_query_attention(
                query,
                key,
                value,
                None if passed == "positions, no mask" else mask,
                scale,
                positions.to(device) if given else None,
                chunks,
            )
        finally:
            decode_attention.BLOCK_KEYS = None

        expected = reference(query.cpu(), key.cpu().nan_to_num(), value.cpu().nan_to_num(), mask.cpu(), scale)
        shape = (batch, heads, kv_heads, n, dim, keys, passed)
        assert out.shape == (batch, n, heads, dim)
        assert torch.isfinite(out).all(), f"non-finite output for {shape}"
        error = ((out.cpu().double() - expected).norm() / expected.norm()).item()
        assert error < tolerance, f"relative error {error:.2e} for {shape}"


@needs_interpreter
def test_the_kernels_equal_float64_attention_in_triton_interpreter() -> None:
    run_in_interpreter("test_decode_attention", "t.check_against_reference('cpu', torch.float32, 1e-5)")


def check_a_model_on_the_kernels() -> None:
    """Steps through `ModelRunner` (a prefill, verify-sized and one-token steps, rows of different lengths) give the
    same logits on the kernels as on the matmul path, and every kernel call got the step's positions from the decoder
    layers (its cut-off; without them the kernels still read every key): with no mask for a Llama-shaped model, whose
    steps' masks are causal by those positions, and with the mask for a model of an 8-token sliding window."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedModel

    import minedraft.engine.attention as attention
    from minedraft.engine.model_runner import ModelRunner
    from minedraft.kernels import decode_attention

    # Weights well above transformers' 0.02 init: attention then moves the logits by far more than the tolerance.
    shape: dict[str, Any] = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,
    )
    given: list[tuple[bool, bool]] = []  # (positions, mask) of each kernel call
    plain = decode_attention.short_query_attention

    def watched(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        given.append((positions is not None, mask is not None))
        return plain(query, key, value, mask, scale, positions)

    def steps(model: PreTrainedModel, on_kernels: bool) -> list[torch.Tensor]:
        # On the CPU the kernels run only if asked (here through Triton's interpreter).
        attention.KERNELS = decode_attention if on_kernels else None
        attention.uses_kernel = lambda q, k, v, m, queries: (
            on_kernels  # type: ignore
            and queries <= attention.SHORT_QUERY
            and decode_attention.supports(q, k, v, m)
        )
        runner = ModelRunner(model, 4, 256)
        rows = torch.tensor(runner.allocate(2))
        generator = torch.Generator().manual_seed(1)
        out = [
            runner.forward(
                rows, torch.randint(0, 300, (2, 12), generator=generator), torch.tensor([12, 7]), last_only=True
            )
        ]
        for n in (5, 1, 5):
            out.append(runner.forward(rows, torch.randint(0, 300, (2, n), generator=generator), torch.full((2,), n)))
        return out

    decode_attention.short_query_attention = watched  # type: ignore[assignment]
    for config, masked in ((LlamaConfig(**shape), False), (MistralConfig(sliding_window=8, **shape), True)):
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        given.clear()
        for kernels, matmuls in zip(steps(model, True), steps(model, False), strict=True):
            torch.testing.assert_close(kernels, matmuls, atol=1e-4, rtol=1e-4)
        assert given and set(given) == {(True, masked)}, (type(config).__name__, given)


@needs_interpreter
def test_a_model_on_the_kernels_equals_the_matmul_path_in_triton_interpreter() -> None:
    run_in_interpreter("test_decode_attention", "t.check_a_model_on_the_kernels()")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernels_equal_float64_attention_on_a_gpu() -> None:
    """On each GPU (the kernels must launch on their tensors' GPU, whichever is current)."""
    for index in range(torch.cuda.device_count()):
        check_against_reference(f"cuda:{index}", torch.float32, 1e-5)
        check_against_reference(f"cuda:{index}", torch.bfloat16, 2e-2)


def test_the_kernels_take_only_the_shapes_they_handle() -> None:
    """Power-of-two head sizes, one size for q/k/v, unit last strides, a mask row per query; CPU steps never."""
    from minedraft.engine.attention import uses_kernel
    from minedraft.kernels.decode_attention import supports

    def inputs(dim: int = 64, value_dim: int = 64, n: int = 5) -> list[torch.Tensor]:
        return [
            torch.randn(2, 8, n, dim),
            torch.randn(2, 2, 40, dim),
            torch.randn(2, 2, 40, value_dim),
            torch.zeros(2, 1, n, 40),
        ]

    assert supports(*inputs())
    assert not supports(*inputs(dim=80, value_dim=80))  # a 80-wide head: not a power of two
    assert not supports(*inputs(value_dim=32))
    query, key, value, mask = inputs()
    assert not supports(query, key.transpose(-1, -2).contiguous().transpose(-1, -2), value, mask)
    assert not supports(query, key, value, torch.zeros(2, 1, 1, 40))  # one mask row for five queries
    assert not uses_kernel(query, key, value, mask, 4 * 5)  # on the CPU
