"""Triton kernels on the CPU in tests: Triton's interpreter, run in a fresh process."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _triton_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return ()


# Triton 3.6's interpreter passes scalar arguments as arrays, which a loop bound refuses.
needs_interpreter = pytest.mark.skipif(
    _triton_version() < (3, 7), reason="needs Triton >= 3.7 (its interpreter takes scalar loop bounds)"
)


def run_in_interpreter(module: str, call: str) -> None:
    """`call` (on the test module `module`, as `t`) in a fresh process with TRITON_INTERPRET=1, which must be set
    before Triton compiles anything; it must print nothing but the final 'ok'."""
    code = f"import torch, {module} as t; {call}; print('ok')"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])]),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
