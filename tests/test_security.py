"""TLS, mTLS and bearer tokens on one secured stack of real processes: who gets in, who does not, what binds where.

Target and draft of the tiny Llama pair serve mTLS only (certificates signed by a CA made here, SAN 127.0.0.1 and
localhost), started without --host: they must bind loopback alone. The coordinator serves TLS on its gRPC and HTTP
ports, talks mTLS to the workers with its own certificate, and wants the API key of a file.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from reference import hf_greedy
from stack import MAX_MODEL_LEN, REPO, SERVICE_ENV, Service, TinyPairs, collect, server_port, spawn, stop_all
from transformers import AutoModelForCausalLM

from coordinator.main import serve
from coordinator.options import CoordinatorOptions
from minedraft.proto import generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from minedraft.rpc.security import ClientTls, client_tls
from minedraft_app.stack import wait_healthy

pytest_plugins = ["stack"]

API_KEY = "s3cret-key-for-tests"
PROMPT = [5, 17, 42, 99, 3, 250, 8]
MAX_TOKENS = 12


# --------------------------------------------------------------------------------------------- certificates


def _name(common: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(directory: Path, name: str) -> tuple[Any, Any]:
    """A self-signed CA: its key and certificate, the certificate written to DIR/NAME-ca.pem."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{name} CA"))
        .issuer_name(_name(f"{name} CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (directory / f"{name}-ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_leaf(directory: Path, name: str, ca: tuple[Any, Any]) -> tuple[Path, Path]:
    """A certificate for both server and client use (SAN IP:127.0.0.1, DNS:localhost) that `ca` signed: its
    (certificate, key) PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@dataclass
class Pki:
    ca: Path
    cert: Path  # every service's and the test client's (one identity per process; here one for all)
    key: Path
    rogue_cert: Path  # signed by another CA
    rogue_key: Path

    def tls(self, client_cert: bool = False, rogue: bool = False) -> ClientTls:
        cert, key = (self.rogue_cert, self.rogue_key) if rogue else (self.cert, self.key)
        tls = client_tls(str(self.ca), str(cert) if client_cert else None, str(key) if client_cert else None)
        assert tls is not None
        return tls


# --------------------------------------------------------------------------------------------- the stack


@dataclass
class SecuredStack:
    pki: Pki
    target: Service
    draft: Service
    coordinator: Service
    http_port: int
    metrics_ports: dict[str, int]
    model_dir: Path


def _worker_args(kind: str, model: Path, pki: Pki, metrics_port: int) -> list[str]:
    """A worker's flags, without --host: its default must be loopback."""
    return [
        kind,
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-batch-size",
        "4",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--metrics-port",
        str(metrics_port),
        *("--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)),
    ]


@pytest.fixture(scope="module")
def secured(
    tiny_pairs: TinyPairs, stack_logs: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SecuredStack]:
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory, "stack")
    cert, key = make_leaf(directory, "service", ca)
    rogue_cert, rogue_key = make_leaf(directory, "rogue", make_ca(directory, "rogue"))
    pki = Pki(directory / "stack-ca.pem", cert, key, rogue_cert, rogue_key)
    key_file = directory / "api-key"
    key_file.write_text(API_KEY + "\n")
    pair = tiny_pairs["llama"]
    metrics = {name: server_port() for name in ("target", "draft", "coordinator")}
    target = spawn("secure-target", _worker_args("target", pair.target, pki, metrics["target"]), stack_logs)
    draft = spawn("secure-draft", _worker_args("draft", pair.draft, pki, metrics["draft"]), stack_logs)
    services = [target, draft]
    try:
        for worker in (target, draft):
            wait_healthy(worker.address, [target.proc, draft.proc], 240, pki.tls(client_cert=True))
        http_port = server_port()
        coordinator = spawn(
            "secure-coordinator",
            [
                "coordinator",
                *("--target", target.address, "--draft", draft.address, "--host", "127.0.0.1"),
                *("--max-batch-size", "4", "--channel", "grpc", "--tokenizer", str(pair.target)),
                *("--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(pki.ca)),
                *("--api-key-file", str(key_file), "--http-port", str(http_port)),
                *("--metrics-port", str(metrics["coordinator"])),
            ],
            stack_logs,
        )
        services.append(coordinator)
        wait_healthy(coordinator.address, [s.proc for s in services], 240, pki.tls())
    except BaseException as exc:
        logs = "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in services)
        stop_all(services)
        raise RuntimeError(f"the secured stack did not start: {exc}\n{logs}") from exc
    yield SecuredStack(pki, target, draft, coordinator, http_port, metrics, pair.target)
    coordinator.stop()  # first: workers stopping under it would cut its streams
    stop_all([target, draft])


def _request() -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return generation_pb2.GenerateRequest(prompt_token_ids=PROMPT, params=params)


def _channel(address: str, tls: ClientTls | None) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(address, tls.credentials)


async def _generate(address: str, tls: ClientTls | None, metadata: list[tuple[str, str]] | None) -> list[int]:
    async with _channel(address, tls) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return (await collect(stub.Generate(_request(), timeout=60, metadata=metadata))).token_ids


def _code(coro: Any) -> grpc.StatusCode:
    """The status a call ends with (OK if it succeeds)."""
    try:
        asyncio.run(coro)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


BEARER = [("authorization", f"Bearer {API_KEY}")]


# --------------------------------------------------------------------------------------------- the public port


def test_a_tls_client_with_the_token_gets_the_targets_own_tokens(secured: SecuredStack) -> None:
    tokens = asyncio.run(_generate(secured.coordinator.address, secured.pki.tls(), BEARER))
    model = AutoModelForCausalLM.from_pretrained(secured.model_dir, dtype=torch.float32)
    assert tokens == hf_greedy(model, PROMPT, MAX_TOKENS)


def test_a_plaintext_client_gets_nothing_from_the_tls_port(secured: SecuredStack) -> None:
    assert _code(_generate(secured.coordinator.address, None, BEARER)) == grpc.StatusCode.UNAVAILABLE


def test_calls_without_the_token_are_unauthenticated_but_health_and_reflection_stay_open(
    secured: SecuredStack,
) -> None:
    address, tls = secured.coordinator.address, secured.pki.tls()
    wrong = [("authorization", f"Bearer {API_KEY}x")]
    for metadata in (None, wrong, [("authorization", API_KEY)]):
        assert _code(_generate(address, tls, metadata)) == grpc.StatusCode.UNAUTHENTICATED

    async def info(metadata: Any) -> None:
        async with _channel(address, tls) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            await stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10, metadata=metadata)

    assert _code(info(None)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(info(BEARER)) == grpc.StatusCode.OK
    wait_healthy(address, [secured.coordinator.proc], 10, tls)  # no token: probes carry no secret

    async def reflect(*requests: reflection_pb2.ServerReflectionRequest) -> list[Any]:
        async with _channel(address, tls) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            return [reply async for reply in stub.ServerReflectionInfo(iter(requests), timeout=10)]

    listed, public, internal = asyncio.run(
        reflect(
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="minedraft.v1.GenerationService"),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="minedraft.v1.TargetService"),
        )
    )
    names = {s.name for s in listed.list_services_response.service}
    assert names == {
        "minedraft.v1.GenerationService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert public.file_descriptor_response.file_descriptor_proto
    assert internal.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_the_http_api_wants_the_token_over_https(secured: SecuredStack) -> None:
    base_url = f"https://127.0.0.1:{secured.http_port}/v1"
    verify = ssl.create_default_context(cafile=str(secured.pki.ca))

    def client(key: str) -> openai.OpenAI:
        http = openai.DefaultHttpx2Client(verify=verify)
        return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60, http_client=http)

    with pytest.raises(openai.AuthenticationError) as refused:
        client("wrong").models.list()
    assert refused.value.status_code == 401
    body: Any = refused.value.body  # the error object's fields (the client unwraps "error")
    assert body["code"] == "invalid_api_key" and "--api-key" in body["message"]
    model = client(API_KEY).models.list().data[0].id
    done = client(API_KEY).completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 4

    with urllib.request.urlopen(f"https://127.0.0.1:{secured.http_port}/health", context=verify, timeout=10) as r:
        assert r.status == 200  # no token: /health stays open
    with pytest.raises(OSError):  # plaintext HTTP gets no answer from the TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{secured.http_port}/health", timeout=10)


# --------------------------------------------------------------------------------------------- the workers


def test_a_worker_refuses_clients_without_a_certificate_of_its_ca(secured: SecuredStack) -> None:
    async def get_info(tls: ClientTls | None) -> None:
        async with _channel(secured.target.address, tls) as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            await stub.GetInfo(target_pb2.TargetServiceGetInfoRequest(), timeout=10)

    pki = secured.pki
    assert _code(get_info(pki.tls(client_cert=True))) == grpc.StatusCode.OK  # the real thing gets in
    for tls in (None, pki.tls(), pki.tls(client_cert=True, rogue=True)):
        assert _code(get_info(tls)) == grpc.StatusCode.UNAVAILABLE


def test_a_coordinator_pairs_only_with_its_ca_certificate_and_the_workers_name(secured: SecuredStack) -> None:
    base = dict(target=secured.target.address, draft=secured.draft.address, max_batch_size=4, channel="grpc")
    pki = secured.pki
    ours = {"tls_ca": str(pki.ca), "tls_cert": str(pki.cert), "tls_key": str(pki.key)}
    rogue = {**ours, "tls_cert": str(pki.rogue_cert), "tls_key": str(pki.rogue_key)}
    misnamed = {**ours, "tls_server_name": "not-the-worker.example"}  # the workers' certificates do not carry it
    for tls in ({}, rogue, misnamed):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(serve(CoordinatorOptions(**base, **tls), 0, "127.0.0.1"))  # type: ignore[arg-type]
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


def _listening(port: int) -> set[str]:
    """The local addresses of the sockets listening on TCP `port` (/proc/net/tcp and tcp6, hex as the kernel writes)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each word little-endian
                ip = ipaddress.ip_address(words)
                mapped = getattr(ip, "ipv4_mapped", None)  # gRPC listens on IPv4 through an IPv6 socket
                found.add(str(mapped or ip))
    return found


def _outside_address() -> str | None:
    """An address of this host that is not loopback, if it has one (the interface a route out would take)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet leaves: this only picks the interface
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback else address


def test_workers_and_metrics_bind_loopback_by_default(secured: SecuredStack) -> None:
    ports = {
        "target": secured.target.port,
        "draft": secured.draft.port,
        **{f"{name} metrics": port for name, port in secured.metrics_ports.items()},
    }
    for name, port in ports.items():
        assert _listening(port) == {"127.0.0.1"}, name
    outside = _outside_address()
    if outside is not None:
        for name, port in ports.items():
            with pytest.raises(OSError), socket.create_connection((outside, port), timeout=5):
                pytest.fail(f"{name} answers on {outside}")


# --------------------------------------------------------------------------------------------- the CLI, the nccl store


def test_minedraft_generate_reaches_the_secured_stack_with_its_flags(secured: SecuredStack) -> None:
    def generate(*flags: str) -> subprocess.CompletedProcess[str]:
        line = ["generate", "--server", f"localhost:{secured.coordinator.port}", "--prompt-ids", "5,17,42"]
        env = {k: v for k, v in SERVICE_ENV.items() if k != "MINEDRAFT_API_KEY"}
        return subprocess.run(
            [sys.executable, "-m", "minedraft_app", *line, "--max-tokens", "4", "--json", *flags],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    ca = str(secured.pki.ca)
    done = generate("--tls-ca", ca, "--api-key", API_KEY)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["usage"]["completion_tokens"] == 4
    refused = generate("--tls-ca", ca)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr and "--api-key" in refused.stderr
    plain = generate("--api-key", API_KEY)
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr and "--tls-ca" in plain.stderr


def test_the_nccl_rendezvous_listens_on_the_address_it_advertises_alone() -> None:
    from minedraft.channels.nccl import _listen

    with _listen("127.0.0.1") as listener:
        assert _listening(listener.getsockname()[1]) == {"127.0.0.1"}
    with _listen("192.0.2.1") as listener:  # not this host's (TEST-NET-1): every interface, with a warning
        assert _listening(listener.getsockname()[1]) == {"0.0.0.0"}


def test_wrong_security_flags_fail_with_the_flag_named(tmp_path: Path) -> None:
    from minedraft.rpc.security import bearer_matches, read_api_key, server_credentials, worker_credentials

    cert, key = make_leaf(tmp_path, "one", make_ca(tmp_path, "one"))
    _, other_key = make_leaf(tmp_path, "two", make_ca(tmp_path, "two"))
    ca = str(tmp_path / "one-ca.pem")
    cases = [
        (lambda: worker_credentials(str(cert), str(key), None), "missing --tls-ca"),
        (lambda: server_credentials(str(cert), None), "--tls-cert and --tls-key go together"),
        (lambda: server_credentials(str(cert), str(other_key)), "KEY_VALUES_MISMATCH"),
        (lambda: server_credentials(str(cert), str(key), str(tmp_path / "none.pem")), "--tls-ca"),
        (lambda: server_credentials(str(tmp_path / "one-ca.pem.missing"), str(key)), "cannot read it"),
        (lambda: read_api_key("a", str(tmp_path / "key")), "not both"),
        (lambda: read_api_key(None, str(tmp_path / "none")), "--api-key-file"),
        (lambda: read_api_key(" a ", None), "spaces"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert worker_credentials(str(cert), str(key), ca) is not None
    assert worker_credentials(None, None, None) is None
    assert read_api_key(None, None) is None
    assert bearer_matches(f"Bearer {API_KEY}", API_KEY) and bearer_matches(f"bearer {API_KEY}".encode(), API_KEY)
    assert not any(bearer_matches(h, API_KEY) for h in (None, "", API_KEY, f"Basic {API_KEY}", f"Bearer {API_KEY}1"))
