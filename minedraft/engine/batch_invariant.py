"""`--deterministic`: each row's matmuls, norms and attention computed the same way whatever else the step carries.

In bfloat16 a matmul's per-row result depends on M on both devices: oneDNN on a CPU picks its blocking (and with it
the order of the K reduction) by shape, 512 x 1536 weights already giving other bits at M = 8 than at M = 1; cuBLAS
picks kernels and split-K by shape. A verify multiplies B x (k + 1) rows where a decode multiplies B, so greedy
tokens differed between ar, sd and psd. `InvariantMode`, entered around a step's forward, routes the matmuls through
shapes that do not depend on M (`invariant_mm`, `invariant_bmm`) and, on CUDA, the row means of the norms through a
Triton kernel (Llama-style norms whole: `fuse_norms`); attention takes `fixed_split_attention` (gathered K/V) or the
paged kernel with a fixed key split.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from minedraft.kernels import triton_runs

# Rows per CPU matmul call: every call has this M, so oneDNN's blocking (and the K order of every row) is the same
# whatever the batch holds. 16 rows cost no more than 1 at decode sizes (tests/test_batch_invariant.py measures it).
ROW_CHUNK = 16
# Keys per attention split, counted from position 0: a query row's splits, and its reduction order, are those of its
# position, not of the step's key length or query count.
KEY_SPLIT = 64
# The keyword a deterministic step passes on through the model (True): attention takes the fixed-split paths.
DETERMINISTIC = "minedraft_deterministic"


def _kernels() -> ModuleType | None:
    if not triton_runs():
        return None
    from minedraft.kernels import batch_invariant

    return batch_invariant


KERNELS = _kernels()


def _padded_rows(a: torch.Tensor) -> torch.Tensor:
    """`a` `[..., M, K]` with zero rows appended up to a multiple of ROW_CHUNK, in fresh (aligned) memory."""
    rows = a.shape[-2]
    padded = -(-rows // ROW_CHUNK) * ROW_CHUNK
    out = a.new_zeros(*a.shape[:-2], padded, a.shape[-1])
    out[..., :rows, :] = a
    return out


def invariant_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for `a` `[M, K]`, `b` `[K, N]`, each row's result independent of M and of the other rows."""
    if a.is_cuda and KERNELS is not None:
        return KERNELS.matmul(a, b)
    padded = _padded_rows(a)
    out = torch.cat([torch.mm(padded[i : i + ROW_CHUNK], b) for i in range(0, padded.shape[0], ROW_CHUNK)])
    return out[: a.shape[0]]


def invariant_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` for `a` `[E, M, K]`, `b` `[E, K, N]`: each entry's rows independent of M and of E (on a CPU each call
    is E entries of ROW_CHUNK rows: oneDNN's batched kernels compute every entry alike)."""
    if a.shape[-1] == 1:  # one product per element (rotary angles): exact whatever the shape
        return torch.bmm(a, b)
    if a.is_cuda and KERNELS is not None:  # one launch for all entries, each entry's rows as `matmul` gives them
        return KERNELS.bmm(a, b)
    padded = _padded_rows(a)
    parts = [torch.bmm(padded[:, i : i + ROW_CHUNK], b) for i in range(0, padded.shape[1], ROW_CHUNK)]
    return torch.cat(parts, 1)[:, : a.shape[1]]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    product = invariant_mm(a, b)
    if alpha != 1:
        product = product * alpha
    return product + (bias if beta == 1 else bias * beta)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = invariant_mm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul's broadcasting, for 2-D and batched operands, over `invariant_mm` and `invariant_bmm`."""
    if a.dim() < 2 or b.dim() < 2:
        return torch.matmul(a, b)
    if b.dim() == 2:
        return invariant_mm(a.reshape(-1, a.shape[-1]), b).view(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    left = a.expand(*batch, *a.shape[-2:]).reshape(-1, *a.shape[-2:])
    right = b.expand(*batch, *b.shape[-2:]).reshape(-1, *b.shape[-2:])
    return invariant_bmm(left, right).view(*batch, a.shape[-2], b.shape[-1])


def _rms_norm(
    x: torch.Tensor, shape: Any, weight: torch.Tensor | None = None, eps: float | None = None
) -> torch.Tensor:
    """torch's rms_norm over the last dimension, its mean by `_mean`."""
    assert len(shape) == 1, "--deterministic covers RMS norms over the last dimension"
    upcast = x.float()
    variance = _mean(upcast * upcast, [-1], keepdim=True)
    out = (upcast * torch.rsqrt(variance + (torch.finfo(x.dtype).eps if eps is None else eps))).to(x.dtype)
    return out if weight is None else out * weight


def _mean(x: torch.Tensor, dims: Any, keepdim: bool = False, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A row mean over the last dimension by the Triton kernel (one order per row); other means as torch's."""
    last = list(dims or []) in ([-1], [x.dim() - 1])
    if KERNELS is None or not x.is_cuda or not last or dtype not in (None, x.dtype):
        return torch.ops.aten.mean.dim(x, dims, keepdim, dtype=dtype)
    out = KERNELS.row_mean(x)
    return out if keepdim else out.squeeze(-1)


def _cumsum(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch's cumsum, except that on CUDA a tensor of one row is scanned as one of two: PyTorch scans a lone row with
    cub's device-wide scan (another order) and several rows one per thread block (the order of any one row)."""
    if x.is_cuda and x.numel() == x.shape[dim] and x.numel() > 1:
        return torch.ops.aten.cumsum.default(torch.stack([x, x]), dim % x.dim() + 1, dtype=dtype)[0]
    return torch.ops.aten.cumsum.default(x, dim, dtype=dtype)


class InvariantMode(TorchDispatchMode):
    """Inside it, matmuls (`mm`, `addmm`, `bmm`) and, on CUDA, last-dimension means compute each row the same way
    whatever M. The rest a step runs already is per row: elementwise ops, softmax (one row per block or thread on
    CUDA, per row on a CPU), argmax (exact). Enters no dispatch of its own: a CUDA graph captures the kernels it picks,
    and replays cost nothing extra."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        replaced = _REPLACED.get(func)
        if replaced is not None:
            return replaced(*args, **kwargs)
        return func(*args, **kwargs)


def invariant_mode_active() -> bool:
    """Whether an `InvariantMode` is on."""
    return any(isinstance(mode, InvariantMode) for mode in _get_current_dispatch_mode_stack())


def invariant_mode(enabled: bool) -> contextlib.AbstractContextManager[object]:
    """An `InvariantMode` where `enabled` and none is on already (the runner's around a step's body, the forward's
    own for calls outside one), else nothing."""
    if not enabled or invariant_mode_active():
        return contextlib.nullcontext()
    return InvariantMode()


_REPLACED: dict[Any, Callable[..., torch.Tensor]] = {
    torch.ops.aten.mm.default: invariant_mm,
    torch.ops.aten.addmm.default: _addmm,
    torch.ops.aten.bmm.default: invariant_bmm,
    torch.ops.aten.mean.dim: _mean,
    torch.ops.aten.cumsum.default: _cumsum,  # (sampling's top-p and inverse CDF)
    # Composite ops reach the mode whole under inference_mode (their parts do not): taken apart here.
    torch.ops.aten.linear.default: _linear,
    torch.ops.aten.matmul.default: _matmul,
    torch.ops.aten.rms_norm.default: _rms_norm,
}


@functools.cache
def _llama_norm_source() -> str:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return inspect.getsource(LlamaRMSNorm.forward)


_LLAMA_NORM: dict[str, bool] = {}  # by class, qualified name


def _is_llama_norm(cls: type[torch.nn.Module]) -> bool:
    """Whether `cls.forward` is Llama's RMSNorm as it is (Qwen2/3's and Mistral's are copies; Gemma's scales by
    1 + weight in float32: not)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    if name not in _LLAMA_NORM:
        try:
            _LLAMA_NORM[name] = inspect.getsource(cls.forward) == _llama_norm_source()
        except (OSError, TypeError):
            _LLAMA_NORM[name] = False
    return _LLAMA_NORM[name]


def _fused_norm_forward(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm as one Triton kernel inside an `InvariantMode` on CUDA, else the module's own forward."""
    weight = module.weight
    eps = module.variance_epsilon
    assert isinstance(weight, torch.Tensor) and isinstance(eps, float | int), (type(weight), type(eps))
    if (
        KERNELS is None
        or not hidden_states.is_cuda
        or weight.dtype != hidden_states.dtype
        or not invariant_mode_active()
    ):
        return type(module).forward(module, hidden_states)
    return KERNELS.rms_norm(hidden_states, weight, float(eps))


def fuse_norms(model: torch.nn.Module) -> int:
    """Where the Triton kernels run: give each Llama-style RMSNorm of `model` the one-kernel forward inside an
    `InvariantMode` (its 7 operations are 7 kernels each: 455 in an 8B step's graph); returns how many. Outside the
    mode the norms compute as before."""
    if KERNELS is None:
        return 0
    fused = 0
    for module in model.modules():
        if _is_llama_norm(type(module)) and isinstance(getattr(module, "weight", None), torch.Tensor):
            module.forward = types.MethodType(_fused_norm_forward, module)  # type: ignore[method-assign]
            fused += 1
    return fused


def fixed_split_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v, `[B, n, heads, D]`, for `query` `[B, heads, n, D]` over gathered `key` and
    `value` `[B, kv_heads, L, D]` with the additive `mask` `[B, 1, n, L]` (0 where seen, the dtype's minimum where
    not), in float32: the keys in splits of KEY_SPLIT from position 0, merged one after the other by a running
    maximum (flash-decoding's merge, in a fixed order). A split that a query row sees none of leaves it exactly as
    it was (weight exp(-inf) = 0, rescale exp(0) = 1), so the row's result depends on its own position only, not
    on L or on how many query rows the step has."""
    batch, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    rows = groups * n
    q = query.reshape(batch * kv_heads, rows, dim).float()  # query head h reads K/V head h // groups
    k = key.reshape(batch * kv_heads, length, dim)
    v = value.reshape(batch * kv_heads, length, value.shape[-1])
    hidden = mask <= torch.finfo(mask.dtype).min
    bias = mask.float().masked_fill(hidden, float("-inf"))
    bias = bias[:, :, None].expand(batch, kv_heads, groups, n, length).reshape(batch * kv_heads, rows, length)
    best = torch.full((batch * kv_heads, rows), float("-inf"), device=query.device)
    total = torch.zeros(batch * kv_heads, rows, device=query.device)
    acc = torch.zeros(batch * kv_heads, rows, v.shape[-1], device=query.device)
    for start in range(0, length, KEY_SPLIT):
        keys, values, seen = (t[:, start : start + KEY_SPLIT] for t in (k, v, bias.transpose(1, 2)))
        short = KEY_SPLIT - keys.shape[1]
        if short:  # the last split padded to full size: every split's matmul has the same shape
            keys = torch.nn.functional.pad(keys, (0, 0, 0, short))
            values = torch.nn.functional.pad(values, (0, 0, 0, short))
            seen = torch.nn.functional.pad(seen, (0, 0, 0, short), value=float("-inf"))
        scores = invariant_bmm(q, keys.float().transpose(1, 2)) * scale + seen.transpose(1, 2)
        new_best = torch.maximum(best, scores.amax(-1))
        anchor = torch.where(new_best == float("-inf"), 0.0, new_best)  # (nothing seen yet: weights stay 0)
        weights = torch.exp(scores - anchor[..., None])
        rescale = torch.exp(best - anchor)
        total = total * rescale + weights.sum(-1)
        acc = acc * rescale[..., None] + invariant_bmm(weights, values.float())
        best = new_best
    out = acc / total.clamp(min=1e-30)[..., None]
    out = out.to(query.dtype).reshape(batch, kv_heads, groups, n, -1).reshape(batch, heads, n, -1)
    return out.transpose(1, 2).contiguous()
