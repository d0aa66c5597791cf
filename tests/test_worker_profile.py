"""`--profile-dir`: a worker writes profiler traces of five model calls after its warm-up, and answers as usual."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

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
