"""Each script in `benchmarks/` earns its place: a gpu_run.sh stage or docs/benchmarks.md names it, or imports it."""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
REFERRERS = (BENCHMARKS / "gpu_run.sh", REPO / "docs" / "benchmarks.md")


def imported(script: Path) -> set[str]:
    """The names of the `benchmarks.NAME` modules `script` imports."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
            modules = [f"benchmarks.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        else:
            continue
        names |= {m.split(".")[1] for m in modules if m.startswith("benchmarks.")}
    return names


def unreferenced(bench_dir: Path, referrers: Sequence[Path]) -> list[str]:
    """The scripts of `bench_dir` that no file of `referrers` names (`NAME.py`) and no named script imports, directly
    or through another."""
    scripts = {path.stem: path for path in bench_dir.glob("*.py")}
    text = "\n".join(path.read_text() for path in referrers)
    reached = {name for name in scripts if re.search(rf"\b{name}\.py\b", text)}
    todo = list(reached)
    while todo:
        for name in imported(scripts[todo.pop()]) & (scripts.keys() - reached):
            reached.add(name)
            todo.append(name)
    return sorted(scripts.keys() - reached)


def test_every_benchmark_is_run_or_cited() -> None:
    assert unreferenced(BENCHMARKS, REFERRERS) == [], "name it in a gpu_run.sh stage or docs/benchmarks.md, or drop it"


def test_every_named_benchmark_exists() -> None:
    """A command in gpu_run.sh or the docs runs a script that is there (not one renamed or retired since)."""
    text = "\n".join(path.read_text() for path in REFERRERS)
    # (`git show COMMIT:benchmarks/NAME.py` names a retired one on purpose)
    named = set(re.findall(r"(?<![:\w])(?:benchmarks|\$HERE)/(\w+)\.py", text))
    assert named and sorted(n for n in named if not (BENCHMARKS / f"{n}.py").exists()) == []


def test_the_check_catches_an_unreferenced_script(tmp_path: Path) -> None:
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "run.py").write_text("from benchmarks.helper import x\n")
    (bench / "helper.py").write_text("import benchmarks.deeper as deeper\n")
    (bench / "deeper.py").write_text("x = 1\n")
    (bench / "orphan.py").write_text("from benchmarks import helper\n")  # imports a reached one, is not reached
    stage = tmp_path / "gpu_run.sh"
    stage.write_text("python3 benchmarks/run.py\n")
    assert unreferenced(bench, [stage]) == ["orphan"]
    stage.write_text("python3 benchmarks/run.py\npython3 benchmarks/orphan.py\n")
    assert unreferenced(bench, [stage]) == []


@pytest.mark.parametrize("script", sorted(BENCHMARKS.glob("*.py")), ids=lambda path: path.name)
def test_benchmark_parses(script: Path) -> None:
    """Importing most of them wants a GPU; that each parses is the check a CPU can make."""
    ast.parse(script.read_text(), filename=str(script))
