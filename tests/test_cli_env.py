"""Flags from MINEDRAFT_<FLAG> environment variables (as the Helm chart sets them), switches included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minedraft_app.cli import build_parser


def test_environment_sets_flags_and_switches_read_true_or_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINEDRAFT_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("MINEDRAFT_COMPILE", "false")  # the chart renders `compile: false` like this
    monkeypatch.setenv("MINEDRAFT_EAGER", "true")
    args = build_parser().parse_args(["target"])
    assert (args.max_batch_size, args.compile, args.eager) == (7, False, True)
    assert build_parser().parse_args(["target", "--compile"]).compile is True  # a flag still wins

    monkeypatch.setenv("MINEDRAFT_COMPILE", "maybe")
    with pytest.raises(SystemExit, match="MINEDRAFT_COMPILE='maybe': expected true or false"):
        build_parser()


def test_serve_passes_its_model_switches_to_the_workers_it_starts() -> None:
    from minedraft_app.stack import stack_commands

    target, *_ = stack_commands(build_parser().parse_args(["serve", "--eager", "--precapture-graphs"]), 1, 2)
    assert "--eager" in target and target[target.index("--precapture-graphs") + 1] == "on"
    target, *_ = stack_commands(build_parser().parse_args(["serve"]), 1, 2)
    assert "--eager" not in target and target[target.index("--precapture-graphs") + 1] == "auto"


def test_target_and_draft_on_one_gpu_share_its_memory() -> None:
    """Each worker sizes its KV cache by --gpu-memory-utilization of the whole GPU: on one GPU they split it."""
    from minedraft_app.stack import stack_commands

    def utilization(*flags: str) -> list[str | None]:
        commands = stack_commands(build_parser().parse_args(["serve", *flags]), 1, 2)
        return [
            c[c.index("--gpu-memory-utilization") + 1] if "--gpu-memory-utilization" in c else None for c in commands
        ]

    assert utilization("--target-device", "cuda:0", "--draft-device", "cuda:0") == ["0.72", "0.18", None]
    assert utilization("--target-device", "cuda", "--draft-device", "cuda:0")[:2] == ["0.72", "0.18"]
    assert utilization("--target-device", "cuda:0", "--draft-device", "cuda:1")[:2] == ["0.9", "0.9"]
    assert utilization("--target-device", "cuda:0", "--draft-device", "cuda:0", "--kv-cache-memory", "8")[:2] == [
        "0.9",
        "0.9",
    ]  # the caches sized by GiB: utilization does not bind
    two_ranks = ("--target-device", "cuda:0", "--tensor-parallel-size", "2")
    assert utilization(*two_ranks, "--draft-device", "cuda:1")[:2] == ["0.72", "0.18"]  # rank 1's GPU
    assert utilization(*two_ranks, "--draft-device", "cuda:2")[:2] == ["0.9", "0.9"]
    two_draft_ranks = ("--draft-device", "cuda:1", "--draft-tensor-parallel-size", "2")
    assert utilization("--target-device", "cuda:2", *two_draft_ranks)[:2] == ["0.72", "0.18"]  # draft rank 1's
    assert utilization("--target-device", "cuda:3", *two_draft_ranks)[:2] == ["0.9", "0.9"]


def test_bench_and_serve_give_the_target_its_ranks(tmp_path: Path) -> None:
    """`--tensor-parallel-size` of a `serve` stack, or of one `bench` starts, is the target's,
    `--draft-tensor-parallel-size` the draft's `--tensor-parallel-size`; the coordinator takes neither."""
    from minedraft_app.bench import LocalStack
    from minedraft_app.stack import stack_commands

    flags = ["--tensor-parallel-size", "2", "--draft-tensor-parallel-size", "4"]
    serve = build_parser().parse_args(["serve", *flags])
    bench = LocalStack(build_parser().parse_args(["bench", *flags]), "psd", tmp_path).args
    for args in (serve, bench):
        target, draft, coordinator = stack_commands(args, 1, 2)
        assert target[target.index("--tensor-parallel-size") + 1] == "2", target
        assert draft[draft.index("--tensor-parallel-size") + 1] == "4", draft
        assert "tensor-parallel" not in " ".join(coordinator)


def test_precapture_is_auto_by_default_and_on_where_cuda_graphs_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto precaptures on CUDA with graphs only: on a CPU (no graphs) it would run every shape for nothing."""
    from minedraft.rpc.worker import precaptures

    assert build_parser().parse_args(["target"]).precapture_graphs == "auto"
    assert build_parser().parse_args(["target", "--precapture-graphs"]).precapture_graphs == "on"
    for mode, device, graphs, expected in [
        ("auto", "cpu", True, False),
        ("on", "cpu", True, True),
        ("auto", "cuda", True, True),
        ("auto", "cuda", False, False),
        ("off", "cuda", True, False),
    ]:
        assert precaptures(mode, torch.device(device), graphs) is expected, (mode, device, graphs)

    monkeypatch.setenv("MINEDRAFT_PRECAPTURE_GRAPHS", "true")  # an older chart's boolean
    with pytest.raises(SystemExit, match="MINEDRAFT_PRECAPTURE_GRAPHS='true': expected one of auto, on, off"):
        build_parser()
