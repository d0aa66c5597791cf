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
