"""Tensor parallelism of a loaded model: attention heads and MLP columns split over the ranks of a process group.

Which projections split how comes from transformers' own plan (`config.base_model_tp_plan`: `colwise` splits a
Linear's outputs, `rowwise` its inputs and all-reduces what it returns). The sharding itself is ours: transformers'
`from_pretrained(tp_plan=...)` needs `accelerate` (not a dependency) and makes DTensor parameters, which the fused
projections' concatenation (`fused_projections`), the stacked cache writes and CUDA graphs do not take; plain local
shards and one all-reduce after each row-parallel projection keep every path of the runner as it is. Embeddings and
the LM head stay whole on every rank, so each rank computes the same logits (an all-reduce leaves the same sum on
every rank) and a step's sampling runs identically everywhere.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from minedraft.errors import ModelLoadError

log = logging.getLogger(__name__)

# Styles of transformers' plans that leave a module whole here (norms; embeddings, which we replicate).
REPLICATED_STYLES = {"replicated_with_grad_allreduce", "embedding_rowwise", "isolated"}


@dataclass
class Progress:
    """How far this rank's forwards have come in the group's all-reduces, for a watcher to tell a rank that is stuck
    from one that is slow (`minedraft.rpc.ranks`). Counted on gloo only: on GPUs a collective does not hold the host,
    and the step replays as a CUDA graph, which runs no Python."""

    entered: int = 0  # all-reduces begun
    waiting_since: float | None = None  # (time.monotonic) when the one under way began; None: none is
    synced: float = 0.0  # when the ranks were last in step: the last all-reduce ended (or rank 0 handed on a call)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)
    progress: Progress = field(default_factory=Progress)
    # `--deterministic`: the ranks' partial sums added in rank order (`ordered_all_reduce`), not by the collective
    ordered_sums: bool = False


def tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """transformers' tensor-parallel plan of the model's base model: module name patterns (`layers.*.mlp.up_proj`)
    and their styles."""
    config: Any = model.config  # type: ignore[union-attr]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {})


def _check_divisible(model: torch.nn.Module, size: int) -> None:
    """Heads split whole: a slice of a projection's rows must never cut one."""
    config: Any = model.config  # type: ignore[union-attr]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if count % size:
            raise ModelLoadError(
                f"{type(model).__name__} has {count} {what}, which {size} tensor-parallel ranks cannot split "
                f"evenly: pick a --tensor-parallel-size that divides {count}"
            )


def planned_linears(model: torch.nn.Module, size: int) -> list[tuple[str, torch.nn.Linear, bool]]:
    """The Linears the model's plan splits over `size` ranks: (name in `model`, module, row-parallel or not)."""
    plan = tp_plan(model)
    if not plan:
        raise ModelLoadError(
            f"{type(model).__name__} has no tensor-parallel plan in transformers (base_model_tp_plan): serve it "
            "with --tensor-parallel-size 1"
        )
    _check_divisible(model, size)
    patterns = [(re.compile(re.escape(k).replace(r"\*", r"\d+")), style) for k, style in plan.items()]
    base = getattr(model, "base_model", model)
    prefix = next(name for name, module in model.named_modules() if module is base)
    linears = []
    for name, module in base.named_modules():
        style = next((s for pattern, s in patterns if pattern.fullmatch(name)), None)
        if style is None or style in REPLICATED_STYLES:
            continue
        if style not in ("colwise", "rowwise") or type(module) is not torch.nn.Linear:
            raise ModelLoadError(
                f"{name} of {type(model).__name__} ({type(module).__name__}) is planned {style!r}, which this "
                "engine does not shard: only plain Linear layers split by rows or columns"
            )
        linears.append((f"{prefix}.{name}" if prefix else name, module, style == "rowwise"))
    return linears


def split_dim(parameter: str, rowwise: bool) -> int | None:
    """The dimension along which `parameter` (weight or bias) of a planned Linear splits; None: it stays whole (a
    row-parallel bias, which rank 0 alone adds)."""
    if parameter == "weight":
        return 1 if rowwise else 0
    return None if rowwise else 0


def shard_index(shape: Sequence[int], dim: int, tp: TensorParallel) -> tuple[slice, ...]:
    """The index of rank `tp.rank`'s part of a tensor of `shape` split along `dim`: the rank-th of `tp.size` equal
    contiguous ranges (heads split whole, as `_check_divisible` made sure). Indexes a tensor or a safetensors slice."""
    size = shape[dim]
    if size % tp.size:
        raise ModelLoadError(f"a projection of {size} features does not split over {tp.size} ranks")
    part = size // tp.size
    return (slice(None),) * dim + (slice(tp.rank * part, (tp.rank + 1) * part),)


def planned_splits(model: torch.nn.Module, tp: TensorParallel) -> dict[str, int | None]:
    """Every parameter of the planned Linears by its name in `model`, with the dimension it splits along (None: kept
    whole on rank 0, absent elsewhere), for a loader that reads only this rank's part (`minedraft.engine.models`)."""
    splits: dict[str, int | None] = {}
    for name, module, rowwise in planned_linears(model, tp.size):
        for parameter in ("weight", "bias"):
            if getattr(module, parameter, None) is not None:
                splits[f"{name}.{parameter}"] = split_dim(parameter, rowwise)
    return splits


def shard_model(model: torch.nn.Module, tp: TensorParallel) -> int:
    """Keep this rank's shard of every projection the model's plan splits, in place; row-parallel ones all-reduce
    their output (their bias added once, by rank 0). Returns the projections sharded. On a model on the meta device
    it cuts the shapes alone, for the parameters to be read in afterwards."""
    if tp.size == 1:
        return 0
    linears = planned_linears(model, tp.size)
    for _, module, rowwise in linears:
        _shard_linear(module, tp, rowwise=rowwise)
    model._minedraft_tp = tp  # type: ignore[assignment]  # what the runner's collectives run over
    log.info("rank %d of %d holds its shard of %d projections", tp.rank, tp.size, len(linears))
    return len(linears)


def _shard_linear(linear: torch.nn.Linear, tp: TensorParallel, *, rowwise: bool) -> None:
    for parameter in ("weight", "bias"):
        tensor = getattr(linear, parameter)
        dim = split_dim(parameter, rowwise)
        if tensor is None or dim is None:
            continue
        part = tensor[shard_index(tensor.shape, dim, tp)].contiguous()
        setattr(linear, parameter, torch.nn.Parameter(part, requires_grad=False))
    if rowwise:
        linear.in_features = linear.weight.shape[1]
        if linear.bias is not None and tp.rank != 0:
            linear.bias = None  # type: ignore[assignment]  # (added once: the all-reduce sums the ranks' outputs)
        group, progress = tp.group, tp.progress
        reduce = ordered_all_reduce if tp.ordered_sums and tp.size > 2 else dist.all_reduce

        def all_reduce(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
            reduce(output, group=group)
            return output

        def counted_all_reduce(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
            progress.entered += 1
            progress.waiting_since = time.monotonic()
            reduce(output, group=group)
            progress.synced, progress.waiting_since = time.monotonic(), None
            return output

        gloo = dist.is_initialized() and dist.get_backend(group) == "gloo"  # (sharded on the host, whatever its device)
        linear.register_forward_hook(counted_all_reduce if gloo else all_reduce)
    else:
        linear.out_features = linear.weight.shape[0]


def ordered_all_reduce(tensor: torch.Tensor, group: Any = None) -> None:
    """`dist.all_reduce` (a sum, in place) whose every element adds the ranks' parts in rank order. The collectives
    cut a buffer into chunks by its size, and each chunk starts its ring at another rank: with three ranks or more an
    element's order of additions, and its bits, follow from the buffer's size (gloo measured: a row's sum changed
    between M = 1 and M = 64). Two operands add alike in either order, so two ranks need none of this."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    tensor.copy_(total)


def init_group(
    rank: int, size: int, address: str, device: torch.device, timeout_s: float = 60.0, ordered_sums: bool = False
) -> TensorParallel:
    """Join the tensor-parallel group rendezvousing at `address` (host:port, rank 0's): NCCL on GPUs, gloo on CPUs.
    A collective that waits longer than `timeout_s` for a rank fails rather than hangs. `ordered_sums`:
    `TensorParallel.ordered_sums`."""
    from datetime import timedelta

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{address}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
    )
    return TensorParallel(rank, size, dist.group.WORLD, ordered_sums=ordered_sums)


def rank_device(device: str, rank: int) -> str:
    """The device of tensor-parallel rank `rank` when rank 0 runs on `device`: the next GPUs in order (cuda:K is
    rank 0's, cuda:K+1 rank 1's ...); every rank on the CPU."""
    if "," in device:
        raise ModelLoadError(f"--device {device!r} lists several devices: with tensor parallelism give rank 0's alone")
    if not device.startswith("cuda"):
        return device
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"


def same_on_every_rank(value: int, tp: TensorParallel | None, device: torch.device) -> int:
    """The least of every rank's `value`: sizes the ranks must agree on (their KV blocks), whatever each one's free
    memory says."""
    if tp is None or tp.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=tp.group)
    return int(tensor.item())
