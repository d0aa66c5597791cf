"""The protos stay compatible with the last release: `buf breaking` against its protos, taken from git history."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Round 1's last main commit before this round's proto changes (`git log -- protos/`): what deployed clients speak.
RELEASE = "607e410962cd56ca09f3ee1b16d81e3d274e7aa6"
# Wire and JSON compatibility: what an old client, generated in any language, needs of a new server.
WIRE_JSON = json.dumps({"version": "v2", "modules": [{"path": "protos"}], "breaking": {"use": ["WIRE_JSON"]}})
# What buf.yaml's FILE rules (generated source compatibility) report against RELEASE, accepted on purpose: unset
# and 0 now differ for these two (the issue's `top_p = 0` is INVALID_ARGUMENT). On the wire an old client's 0 was
# never sent, so it still reads as unset and means what it meant; only code generated with explicit presence
# changes (Go's *float32, has_top_p() in C++).
ACCEPTED = {
    ("protos/minedraft/v1/generation.proto", "FIELD_SAME_CARDINALITY", '"max_tokens" on message "SamplingParams"'),
    ("protos/minedraft/v1/generation.proto", "FIELD_SAME_CARDINALITY", '"top_p" on message "SamplingParams"'),
}


def _buf() -> str:
    buf = shutil.which("buf")
    if buf is None:
        pytest.skip("`buf` is not on PATH (pip install buf-bin, in the dev extra)")
    return buf


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RELEASE's protos/ and buf.yaml in a folder of their own."""
    if shutil.which("git") is None:
        pytest.skip("git is not on PATH: no history to take the release's protos from")
    archive = subprocess.run(
        ["git", "archive", "--format=tar", RELEASE, "protos", "buf.yaml"], cwd=REPO, capture_output=True, timeout=60
    )
    if archive.returncode != 0:  # a shallow clone, or a copy without .git
        pytest.skip(f"release {RELEASE[:10]} is not in this checkout's history: {archive.stderr.decode().strip()}")
    out = tmp_path_factory.mktemp("release")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    return out


def _breaking(against: Path, source: Path = Path("."), config: str | None = None) -> subprocess.CompletedProcess[str]:
    """`buf breaking` of `source` (the repository by default: paths reported relative to it) against `against`."""
    command = [_buf(), "breaking", str(source), "--against", str(against), "--error-format", "json"]
    if config is not None:
        command += ["--config", config]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def _findings(run: subprocess.CompletedProcess[str]) -> set[tuple[str, str, str]]:
    """(path, rule, what) of each breaking change buf reports; `what` is the field and message it names."""
    found = set()
    for line in run.stdout.splitlines():
        finding = json.loads(line)
        message = finding["message"]
        what = message[message.index('"', message.index("name")) :].split(" changed")[0]
        found.add((finding["path"], finding["type"], what))
    return found


def test_wire_and_json_compatible_with_the_release(release: Path) -> None:
    run = _breaking(release, config=WIRE_JSON)
    assert run.returncode == 0, run.stdout + run.stderr


def test_file_rules_flag_only_the_accepted_presence_changes(release: Path) -> None:
    run = _breaking(release)
    assert run.returncode in (0, 100), run.stderr  # 100: breaking changes found
    assert _findings(run) == ACCEPTED, run.stdout


def test_a_field_number_reused_with_another_type_is_caught(tmp_path: Path) -> None:
    """The check can fail: a copy of today's protos whose GenerateRequest.n became a string breaks against them."""
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    proto = tmp_path / "protos" / "minedraft" / "v1" / "generation.proto"
    text = proto.read_text()
    assert "  uint32 n = 6;\n" in text
    proto.write_text(text.replace("  uint32 n = 6;\n", "  string n = 6;\n"))
    run = _breaking(REPO, source=tmp_path, config=WIRE_JSON)
    assert run.returncode == 100, run.stdout + run.stderr
    assert any(json.loads(line)["type"] == "FIELD_WIRE_JSON_COMPATIBLE_TYPE" for line in run.stdout.splitlines()), (
        run.stdout
    )
