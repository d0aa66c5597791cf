"""`--profile-dir`: a worker writes profiler traces of five model calls after its warm-up, and answers as usual."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from minedraft.demo_models import TARGET_DIR
from minedraft.rpc.options import WorkerOptions
from minedraft.rpc.worker import PROFILED_CALLS, ModelWorker


def test_profiled_calls_are_written_as_chrome_traces(tmp_path: Path) -> None:
    worker = ModelWorker(WorkerOptions(str(TARGET_DIR), profile_dir=str(tmp_path), profile_after=2))

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return worker.model(ids).logits

    ids = torch.tensor([[1, 2, 3]])
    outputs = [worker._on_stream(forward, ids) for _ in range(2 + PROFILED_CALLS + 2)]

    written = sorted(tmp_path.iterdir())
    expected = sorted(f"forward_{os.getpid()}_{n}.json.gz" for n in range(3, 3 + PROFILED_CALLS))
    assert [p.name for p in written] == expected
    with gzip.open(written[0]) as packed:
        trace = json.loads(packed.read())
    assert any(e.get("name") == "aten::linear" for e in trace["traceEvents"])
    assert all(torch.equal(o, outputs[0]) for o in outputs)  # profiling changes nothing of the answers


def test_call_profiles_sums_up_the_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`benchmarks/call_profiles.py` reads the traces a worker wrote: per kind of call, its host operators."""
    traces, scratch = tmp_path / "traces", tmp_path / "scratch"
    scratch.mkdir()
    worker = ModelWorker(WorkerOptions(str(TARGET_DIR), profile_dir=str(traces), profile_after=0))
    for _ in range(PROFILED_CALLS):
        worker._on_stream(lambda ids: worker.model(ids).logits, torch.tensor([[1, 2, 3]]))
    call_profiles = _call_profiles(monkeypatch)

    calls = call_profiles.load(traces, scratch)

    assert list(calls) == ["<lambda>"] and len(calls["<lambda>"]) == PROFILED_CALLS
    for profile in calls["<lambda>"]:
        assert profile.ops.get("aten::linear", 0) > 0, sorted(profile.ops)
        assert 0 < profile.host_ops <= profile.span and profile.op_count > 0


def _call_profiles(monkeypatch: pytest.MonkeyPatch) -> Any:
    spec = importlib.util.spec_from_file_location(
        "call_profiles", Path(__file__).parents[1] / "benchmarks" / "call_profiles.py"
    )
    assert spec is not None and spec.loader is not None
    call_profiles = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "call_profiles", call_profiles)  # (its dataclass looks itself up there)
    spec.loader.exec_module(call_profiles)
    return call_profiles


def test_call_profiles_count_a_ranks_all_reduces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU time of a call's NCCL kernels (a tensor-parallel rank's all-reduces) is told apart from the rest, as
    the kernels of a CUDA trace name them (written here: no GPU runs the test)."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 0, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 20, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x64_64x4", "ts": 40, "dur": 300, "tid": 7},
        {
            "ph": "X",
            "cat": "kernel",
            "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgs)",
            "ts": 340,
            "dur": 60,
            "tid": 7,
        },
    ]
    path = tmp_path / "verify_1_1.json.gz"
    with gzip.open(path, "wt") as trace:
        json.dump({"traceEvents": events}, trace)
    profile = _call_profiles(monkeypatch).profile_of(path)
    assert (profile.kernels, profile.all_reduce, profile.before_launch) == (360, 60, 20)
