"""Flags from MINEDRAFT_<FLAG> environment variables (as the Helm chart sets them), switches included."""

from __future__ import annotations

import pytest

from minedraft.cli import build_parser


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
    from minedraft.cli import stack_commands

    args = build_parser().parse_args(["serve", "--eager", "--precapture-graphs"])
    target, *_ = stack_commands(args, 1, 2)
    assert "--eager" in target and "--precapture-graphs" in target
    target, *_ = stack_commands(build_parser().parse_args(["serve"]), 1, 2)
    assert "--eager" not in target
