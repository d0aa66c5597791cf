"""`minedraft bench`: its statistics, and a run against a live server with --json-out."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack import REPO, SERVICE_ENV, Service, TinyPairs, Workers, running_coordinator

from minedraft.app.bench import RequestResult, _parse_modes, percentile, ratios, summarize

pytest_plugins = ["stack"]


def test_percentile_interpolates() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    assert percentile([5.0], 99) == 5.0


def test_summary_and_ratios() -> None:
    ok = RequestResult(
        True,
        2.0,
        ttft_s=0.1,
        tpot_s=0.02,
        prompt_tokens=10,
        completion_tokens=20,
        draft_tokens=16,
        accepted_tokens=8,
        steps=4,
        drafted_steps=4,
    )
    alone = RequestResult(True, 2.0, prompt_tokens=10, completion_tokens=20, steps=20)  # the target's steps alone
    failed = RequestResult(False, 0.5, error="RESOURCE_EXHAUSTED: full")
    fast = summarize("psd", [ok, ok, failed], wall=2.0, server={})
    assert (fast.completed, fast.failed) == (2, 1)
    assert fast.output_throughput == 20.0 and fast.request_throughput == 1.0
    assert fast.mean_accepted_length == 3.0 and fast.acceptance_rate == 0.5
    assert fast.ttft_ms["p50"] == pytest.approx(100.0) and fast.errors == ["RESOURCE_EXHAUSTED: full"]
    assert fast.drafted_share == 1.0
    mixed = summarize("psd", [ok, alone], wall=2.0, server={})
    assert mixed.drafted_share == round(4 / 24, 4) and mixed.mean_accepted_length == 3.0  # (over drafted steps)
    assert summarize("ar", [alone], wall=2.0, server={}).mean_accepted_length == 1.0
    slow = summarize("sd", [ok], wall=2.0, server={})
    assert ratios({"psd": fast, "sd": slow}) == {"psd/sd": {"request_throughput": 2.0, "output_throughput": 2.0}}


def test_modes_parsing() -> None:
    def parse(modes: str, flag: bool = False) -> list[str]:
        return _parse_modes(argparse.Namespace(modes=modes, sd_batch_equal_concurrency=flag))

    assert parse("psd,sd,ar") == ["psd", "sd", "ar"]
    assert parse("psd,sd,ar", flag=True) == ["psd", "sd", "sd2b", "ar"]
    with pytest.raises(ValueError, match="unknown mode"):
        parse("psd,fast")


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minedraft", "bench", "--no-progress", *args],
        cwd=REPO,
        env=SERVICE_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bad_mode_is_an_error_without_traceback() -> None:
    run = _bench("--modes", "psd,fast")
    assert run.returncode != 0 and "unknown mode" in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Service]:
    with running_coordinator(llama_workers, stack_logs, "psd", max_batch_size=2) as service:
        yield service


def test_bench_a_running_server(coordinator: Service, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = _bench(
        "--server",
        coordinator.address,
        "--num-prompts",
        "6",
        "--concurrency",
        "4",
        "--prompt-len",
        "16",
        "--output-len",
        "8",
        "--num-warmup",
        "1",
        "--json-out",
        str(out),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "TTFT (ms)" in run.stdout and "accepted length" in run.stdout
    report = json.loads(out.read_text())
    assert set(report) == {"date", "command", "config", "results", "ratios", "interrupted"}
    assert report["interrupted"] is False
    result = report["results"]["psd"]
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["mean_output_tokens"] == 8 and result["output_throughput"] > 0
    assert result["mean_accepted_length"] >= 1.0
    assert result["server"]["mode"] == "psd" and result["server"]["max_batch_size"] == 2
    assert set(result["ttft_ms"]) == set(result["tpot_ms"]) == {"p50", "p90", "p99", "mean"}


def test_synthetic_acceptance_reaches_only_the_target_service(tmp_path: Path) -> None:
    from minedraft.app.bench import LocalStack
    from minedraft.app.cli import build_parser
    from minedraft.app.stack import stack_commands

    for extra, expected in (([], None), (["--synthetic-acceptance", "0.7"], "0.7")):
        args = build_parser().parse_args(["bench", "--modes", "psd", *extra])
        target, draft, coordinator = stack_commands(LocalStack(args, "psd", tmp_path).args, 0, 0)
        flag = "--synthetic-acceptance"
        assert (target[target.index(flag) + 1] if flag in target else None) == expected
        assert flag not in draft and flag not in coordinator


def test_an_interrupted_comparison_reports_the_modes_it_finished(tiny_pairs: TinyPairs, tmp_path: Path) -> None:
    """A comparison stopped in its second mode (a benchmark's time limit, Ctrl-C) still writes the first's figures."""
    pair, out = tiny_pairs["llama"], tmp_path / "bench.json"
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minedraft",
            "bench",
            "--no-progress",
            "--modes",
            "psd,sd",
            "--target",
            str(pair.target),
            "--draft",
            str(pair.draft),
            "--max-batch-size",
            "2",
            "--num-prompts",
            "4",
            "--prompt-len",
            "16",
            "--output-len",
            "8",
            "--json-out",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=REPO,
        env=SERVICE_ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert bench.stdout is not None
        for line in bench.stdout:
            if line.startswith("== psd =="):  # printed once psd's summary is kept
                break
        bench.send_signal(signal.SIGINT)  # while the sd stack starts
        _, stderr = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            bench.kill()
    assert bench.returncode == 130, stderr
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and set(report["results"]) == {"psd"}
    assert report["results"]["psd"]["completed"] == 4
