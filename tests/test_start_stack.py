"""A Ctrl-C while `serve` or `bench` starts its services leaves no service running that they do not know of."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from minedraft_app.cli import build_parser
from minedraft_app.stack import start_stack, stop_processes


def test_an_interrupt_inside_popen_still_tracks_the_child() -> None:
    """SIGINT lands after the child exists but before `popen` returns it (Popen waits for the exec): the process
    must still reach the list that `stop_processes` stops."""
    processes: list[subprocess.Popen] = []

    def popen(command: list[str]) -> subprocess.Popen:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        os.kill(os.getpid(), signal.SIGINT)
        return child

    try:
        with pytest.raises(KeyboardInterrupt):
            start_stack(build_parser().parse_args(["serve"]), popen, processes)
        assert len(processes) == 1 and processes[0].poll() is None
    finally:
        stop_processes(processes, timeout=5)
    assert all(p.poll() is not None for p in processes)
