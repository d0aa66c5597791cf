"""checkov for the chart tests, in a venv of its own under the test cache (its dependencies stay out of ours)."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys

from helm_binary import CACHE

VERSION = "3.3.30"
VENV = CACHE / f"checkov-{VERSION}"
MARKER = VENV / ".complete"  # written last: a venv without it is half made and is made again
LOCK = CACHE / f"checkov-{VERSION}.lock"


class CheckovUnavailable(Exception):
    """No checkov: the venv or the install failed (no package registry, say); the message says why."""


def find_checkov() -> str:
    """The venv's checkov, making the venv first where no whole one is there (about 100 MB of wheels, once)."""
    exe = VENV / "bin" / "checkov"
    CACHE.mkdir(parents=True, exist_ok=True)
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second pytest waits for the first's install instead of racing it
        if not MARKER.exists():
            _install()
    return str(exe)


def _install() -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    python = VENV / "bin" / "python"
    steps = (
        [sys.executable, "-m", "venv", str(VENV)],
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"checkov=={VERSION}"],
        [str(VENV / "bin" / "checkov"), "--version"],
    )
    for step in steps:
        try:
            out = subprocess.run(step, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as e:
            raise CheckovUnavailable(f"{' '.join(step[:4])}: {e}") from e
        if out.returncode != 0:
            tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
            raise CheckovUnavailable(f"{' '.join(step[:4])} failed: {' / '.join(tail)}")
    MARKER.write_text(VERSION + "\n")
