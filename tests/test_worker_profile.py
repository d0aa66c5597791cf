"""`--profile-dir`: a worker writes profiler traces of five model calls after its warm-up, and answers as usual."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from minedraft.demo_models import TARGET_DIR
from minedraft.rpc.worker import PROFILED_CALLS, ModelWorker, WorkerOptions


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
    spec = importlib.util.spec_from_file_location(
        "call_profiles", Path(__file__).parents[1] / "benchmarks" / "call_profiles.py"
    )
    assert spec is not None and spec.loader is not None
    call_profiles = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "call_profiles", call_profiles)  # (its dataclass looks itself up there)
    spec.loader.exec_module(call_profiles)

    calls = call_profiles.load(traces, scratch)

    assert list(calls) == ["<lambda>"] and len(calls["<lambda>"]) == PROFILED_CALLS
    for profile in calls["<lambda>"]:
        assert profile.ops.get("aten::linear", 0) > 0, sorted(profile.ops)
        assert 0 < profile.host_ops <= profile.span and profile.op_count > 0
