"""The tree is formatted, lint-clean and type-checked: ruff check, ruff format --check and mypy, as in CI."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run(args: Sequence[str], env: dict[str, str] | None = None) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 0, f"python -m {' '.join(args)} failed:\n{result.stdout}{result.stderr}"


def test_ruff_check() -> None:
    run(["ruff", "check", "."])


def test_ruff_format() -> None:
    run(["ruff", "format", "--check", "."])


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["minedraft", "minedraft_app", "coordinator", "target_service", "draft_service"], {}),
        (["--explicit-package-bases", "benchmarks", "scripts"], {}),
        (["--explicit-package-bases", "tests"], {"MYPYPATH": "tests"}),  # the tests import their helpers by name
    ],
    ids=["packages", "benchmarks-scripts", "tests"],
)
def test_mypy(args: list[str], env: dict[str, str]) -> None:
    run(["mypy", *args], env)
