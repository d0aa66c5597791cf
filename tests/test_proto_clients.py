"""Clients built from protos/ alone, with no generated code, against a real coordinator: Node's @grpc/grpc-js with
@grpc/proto-loader (clients/node/generate.js, skipped without node and npm), and Python loading the .proto files at
run time through grpcio-tools' protoc. The shipped grpc/health/v1/health.proto is the service the servers speak."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from stack import REPO, Service, Workers, generate, run_async, running_coordinator

from minedraft.proto import generation_pb2

pytest_plugins = ["stack"]

PROTOS = REPO / "protos"
NODE_CLIENT = REPO / "clients" / "node"
CACHE = Path(os.environ.get("MINEDRAFT_TEST_CACHE", Path.home() / ".cache" / "minedraft-tests"))
PROMPT = [5, 17, 42, 8, 99, 3]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def coordinator(llama_workers: Workers, stack_logs: Path) -> Iterator[Service]:
    with running_coordinator(llama_workers, stack_logs, "psd", max_batch_size=2) as service:
        yield service


@pytest.fixture(scope="module")
def expected(coordinator: Service) -> list[int]:
    """What the generated Python client gets for the greedy request the other clients send."""
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    request = generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=params)
    return run_async(generate(coordinator.address, request)).token_ids


def _node_modules() -> Path:
    """node_modules of clients/node's lock file, installed once by `npm ci` into the test cache (skips where node,
    npm or the registry are missing)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not on PATH: no Node client to run")
    lock = (NODE_CLIENT / "package-lock.json").read_bytes()
    installed = CACHE / f"node-client-{hashlib.sha256(lock).hexdigest()[:16]}"
    if not installed.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix="node-client-"))
        try:
            for name in ("package.json", "package-lock.json"):
                shutil.copy(NODE_CLIENT / name, tmp)
            # Bounded fetches: a machine without the registry skips in a minute rather than hanging on retries.
            command = ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--fetch-timeout=30000"]
            try:
                run = subprocess.run(
                    command + ["--fetch-retries=1"], cwd=tmp, capture_output=True, text=True, timeout=300
                )
            except subprocess.TimeoutExpired:
                pytest.skip("npm ci of clients/node took over 300 s (no registry?)")
            if run.returncode != 0:
                pytest.skip(f"npm ci of clients/node failed (no registry?): {run.stderr[-500:]}")
            with contextlib.suppress(OSError):  # OSError: a concurrent run installed it first
                tmp.rename(installed)  # whole or not at all: no run finds half a tree
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return installed / "node_modules"


def _node(address: str, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    env = {**os.environ, "NODE_PATH": str(_node_modules())}
    run = subprocess.run(
        ["node", str(NODE_CLIENT / "generate.js"), address, json.dumps(request)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.stdout, run.stderr
    return run.returncode, json.loads(run.stdout)


def test_node_client_from_the_protos_alone(coordinator: Service, expected: list[int]) -> None:
    request = {"prompt_token_ids": PROMPT, "params": {"max_tokens": MAX_TOKENS, "ignore_eos": True}}
    code, answer = _node(coordinator.address, request)
    assert code == 0, answer
    assert answer["health"] == "SERVING"
    assert answer["server_info"]["mode"] == "psd" and answer["server_info"]["max_batch_size"] == 2
    assert answer["token_ids"] == expected
    assert answer["finish_reason"] == "FINISH_REASON_LENGTH"
    assert answer["usage"]["completion_tokens"] == MAX_TOKENS


def test_node_client_explicit_zero_top_p_is_invalid_argument(coordinator: Service) -> None:
    """An explicit 0 in an `optional` field crosses from a protos-only client as set, not as unset."""
    request = {"prompt": "def f(x):", "params": {"top_p": 0, "temperature": 1}}
    code, answer = _node(coordinator.address, request)
    assert code == 3, answer
    assert answer["error"]["name"] == "INVALID_ARGUMENT" and "top_p" in answer["error"]["details"], answer


PYTHON_CLIENT = """
import json, sys
import grpc
protos, services = grpc.protos_and_services("minedraft/v1/generation.proto")
health, health_services = grpc.protos_and_services("grpc/health/v1/health.proto")
assert "minedraft.proto" not in sys.modules
with grpc.insecure_channel(sys.argv[1]) as channel:
    status = health_services.HealthStub(channel).Check(health.HealthCheckRequest(), timeout=30).status
    params = protos.SamplingParams(max_tokens=int(sys.argv[3]), ignore_eos=True)
    request = protos.GenerateRequest(prompt_token_ids=json.loads(sys.argv[2]), params=params)
    ids = [t for m in services.GenerationServiceStub(channel).Generate(request, timeout=120) for t in m.token_ids]
print(json.dumps({"health": health.HealthCheckResponse.ServingStatus.Name(status), "token_ids": ids}))
"""


def test_python_client_from_the_protos_alone(coordinator: Service, expected: list[int], tmp_path: Path) -> None:
    """grpc.protos_and_services compiles the .proto files found on sys.path (protos/ only: not the repository, whose
    generated modules would answer instead)."""
    pytest.importorskip("grpc_tools")
    run = subprocess.run(
        [sys.executable, "-c", PYTHON_CLIENT, coordinator.address, json.dumps(PROMPT), str(MAX_TOKENS)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(PROTOS)},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"health": "SERVING", "token_ids": expected}


def test_the_shipped_health_proto_is_the_service_the_servers_speak(tmp_path: Path) -> None:
    """protos/grpc/health/v1/health.proto, compiled, declares what grpcio-health-checking serves."""
    pytest.importorskip("grpc_tools")
    from google.protobuf import descriptor_pb2
    from grpc_health.v1 import health_pb2
    from grpc_tools import protoc

    out = tmp_path / "health.binpb"
    assert protoc.main(["protoc", f"-I{PROTOS}", f"--descriptor_set_out={out}", "grpc/health/v1/health.proto"]) == 0
    shipped = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    served = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(served)

    def shape(file: descriptor_pb2.FileDescriptorProto) -> tuple[str, list[str], list[tuple[str, list[str]]]]:
        """The package, messages and services, whatever order the file declares them in (and without the JSON names
        protoc fills in: the embedded descriptor leaves them out)."""
        for message in file.message_type:
            for field in [*message.field, *(f for nested in message.nested_type for f in nested.field)]:
                field.ClearField("json_name")
        messages = sorted(str(m) for m in file.message_type)
        services = sorted((s.name, sorted(str(m) for m in s.method)) for s in file.service)
        return file.package, messages, services

    assert shape(shipped) == shape(served)
