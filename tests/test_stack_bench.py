"""`minedraft bench`: its statistics, and a run against a live server with --json-out."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from stack import REPO, SERVICE_ENV, Service, TinyPairs, Workers, running_coordinator, server_port

from minedraft_app.bench import (
    LocalStack,
    RequestResult,
    _parse_modes,
    http_base_url,
    make_prompts,
    percentile,
    ratios,
    summarize,
)
from minedraft_app.cli import build_parser
from minedraft_app.stack import stack_commands

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
    two_gpus = build_parser().parse_args(
        ["bench", "--modes", "psd,sddp", "--target-device", "cuda", "--draft-device", "cuda:1"]
    )
    assert _parse_modes(two_gpus) == ["psd", "sddp"]
    assert _parse_modes(argparse.Namespace(**(vars(two_gpus) | {"target_device": "cpu", "draft_device": "cpu"})))
    one_gpu = argparse.Namespace(**(vars(two_gpus) | {"draft_device": "cuda:0"}))
    with pytest.raises(ValueError, match="name two GPUs"):
        _parse_modes(one_gpu)
    ranks = argparse.Namespace(**(vars(two_gpus) | {"tensor_parallel_size": 2}))
    with pytest.raises(ValueError, match="no tensor parallelism"):
        _parse_modes(ranks)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "minedraft_app", "bench", "--no-progress", *args],
        cwd=REPO,
        env=SERVICE_ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quote_prompts_repeat_the_start_of_their_passage() -> None:
    """`--prompt-kind quote`: three quarters of the length a passage, then its first third again; corpus prompts
    stay as they were (the same seed, the same cuts)."""
    corpus = make_prompts(4, 32, 7, None)
    quotes = make_prompts(4, 32, 7, None, "quote")
    assert [len(p) for p in corpus] == [128] * 4 and make_prompts(4, 32, 7, None) == corpus
    for quote in quotes:
        passage = quote[:96]
        assert len(quote) == 128 and quote[96:] == passage[:32]


def test_http_base_url() -> None:
    for address in ("localhost:8000", "http://localhost:8000", "http://localhost:8000/", "http://localhost:8000/v1"):
        assert http_base_url(address) == "http://localhost:8000"


def test_bad_mode_is_an_error_without_traceback() -> None:
    run = _bench("--modes", "psd,fast")
    assert run.returncode != 0 and "unknown mode" in run.stderr and "Traceback" not in run.stderr, run.stderr


@dataclass
class Served:
    """A coordinator that also serves the OpenAI-compatible HTTP API."""

    service: Service
    http_port: int

    @property
    def address(self) -> str:
        return self.service.address


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Served]:
    with contextlib.ExitStack() as stop:
        for attempt in range(3):  # a port picked here may be taken before the coordinator binds it
            http_port = server_port()
            extra = ["--http-port", str(http_port)]
            try:
                service = stop.enter_context(
                    running_coordinator(llama_workers, stack_logs, "psd", max_batch_size=2, extra=extra)
                )
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        yield Served(service, http_port)


def _load_flags(out: Path) -> list[str]:
    """A small load: 6 prompts of 16 tokens, 8 output tokens each, 4 in flight, its report to `out`."""
    return [
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
    ]


def test_bench_a_running_server(coordinator: Served, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    run = _bench("--server", coordinator.address, *_load_flags(out))
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


def test_bench_a_running_server_over_http(coordinator: Served, tmp_path: Path) -> None:
    """The same load through the OpenAI-compatible HTTP API (streamed completions): the same figures come back."""
    out = tmp_path / "bench.json"
    run = _bench("--api", "http", "--server", f"127.0.0.1:{coordinator.http_port}", *_load_flags(out))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "over the HTTP API" in run.stdout and "TTFT (ms)" in run.stdout, run.stdout
    result = json.loads(out.read_text())["results"]["http"]
    assert (result["completed"], result["failed"]) == (6, 0), result["errors"]
    assert result["mean_output_tokens"] == 8 and result["mean_prompt_tokens"] > 0 and result["output_throughput"] > 0
    assert result["ttft_ms"]["p50"] > 0 and result["tpot_ms"]["p50"] > 0  # every stream timed
    assert result["latency_s"]["p50"] * 1e3 > result["ttft_ms"]["p50"]
    assert result["mean_accepted_length"] >= 1.0 and result["drafted_share"] > 0  # usage.speculation was read
    assert result["server"]["api"] == "http" and result["server"]["target_model"]


def test_bench_a_dead_http_server_is_an_error_without_traceback() -> None:
    run = _bench("--api", "http", "--server", f"127.0.0.1:{server_port()}", "--num-prompts", "1")
    assert run.returncode == 1 and "not serving" in run.stderr and "Traceback" not in run.stderr, run.stderr


def test_modes_over_http_serve_it_on_a_port_of_their_own(tmp_path: Path) -> None:
    def coordinator_http_port(*flags: str) -> int:
        args = build_parser().parse_args(["bench", "--modes", "psd", *flags])
        command = stack_commands(LocalStack(args, "psd", tmp_path).args, 0, 0)[-1]
        return int(command[command.index("--http-port") + 1]) if "--http-port" in command else 0

    assert coordinator_http_port() == 0  # over gRPC: no HTTP API
    assert coordinator_http_port("--api", "http") > 0
    assert coordinator_http_port("--api", "http", "--http-port", "8123") == 8123


def test_synthetic_acceptance_reaches_only_the_target_service(tmp_path: Path) -> None:
    for extra, expected in (([], None), (["--synthetic-acceptance", "0.7"], "0.7")):
        args = build_parser().parse_args(["bench", "--modes", "psd", *extra])
        target, draft, coordinator = stack_commands(LocalStack(args, "psd", tmp_path).args, 0, 0)
        flag = "--synthetic-acceptance"
        assert (target[target.index(flag) + 1] if flag in target else None) == expected
        assert flag not in draft and flag not in coordinator


def test_an_interrupted_comparison_reports_the_modes_it_finished(tiny_pairs: TinyPairs, tmp_path: Path) -> None:
    """A comparison stopped in its second mode (a benchmark's time limit, Ctrl-C) still writes the first's figures,
    of a load sent once."""
    pair, out = tiny_pairs["llama"], tmp_path / "bench.json"
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minedraft_app",
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
            "--step-trace-dir",
            str(tmp_path / "traces"),
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
    # Each request sent once: the two warm-up requests and the four of the load, each prefilled once.
    calls = [json.loads(line) for line in (tmp_path / "traces" / "psd.jsonl").read_text().splitlines()]
    assert sum(c["batch_size"] for c in calls if c["kind"] == "prefill") == 2 + 4


def test_data_parallel_sd_splits_the_load_over_two_stacks(tiny_pairs: TinyPairs, tmp_path: Path) -> None:
    """sddp: two independent sd stacks (here both on the CPU), each warmed up and each given a share of the load,
    reported as one mode."""
    pair, out = tiny_pairs["llama"], tmp_path / "bench.json"
    run = _bench(
        "--modes",
        "sddp",
        "--target",
        str(pair.target),
        "--draft",
        str(pair.draft),
        "--max-batch-size",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--step-trace-dir",
        str(tmp_path / "traces"),
        *_load_flags(out),
    )
    assert run.returncode == 0, run.stderr
    assert "2 stacks sharing the load" in run.stdout
    result = json.loads(out.read_text())["results"]["sddp"]
    assert (result["completed"], result["failed"]) == (6, 0) and result["server"]["mode"] == "sd"
    prefilled = []
    for stack in ("sddp0", "sddp1"):
        calls = [json.loads(line) for line in (tmp_path / "traces" / f"{stack}.jsonl").read_text().splitlines()]
        prefilled.append(sum(c["batch_size"] for c in calls if c["kind"] == "prefill"))
        assert (tmp_path / "logs" / f"{stack}.log").exists()
    # One warm-up each; of the four streams two go to each stack, and each stream takes one of the first four prompts.
    assert sum(prefilled) == 2 + 6 and min(prefilled) >= 1 + 2, prefilled
