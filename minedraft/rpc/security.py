"""TLS from PEM files, mTLS between the coordinator and its workers, and bearer tokens on the public APIs."""

from __future__ import annotations

import hmac
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health

# Services a client reaches without the token: probes must work without a secret, reflection describes the API.
OPEN_SERVICES = (health.SERVICE_NAME, "grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")
UNAUTHENTICATED = (
    "missing or wrong API key: send the header `authorization: Bearer <key>` with the coordinator's --api-key "
    "(minedraft generate --api-key, OpenAI clients' api_key)"
)


def read_pem(path: str, flag: str) -> bytes:
    """The bytes of a PEM file named by `flag`; ValueError says what is wrong with it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc
    if b"-----BEGIN" not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def check_pair(cert: str, key: str) -> None:
    """That the key is the certificate's (gRPC would say only that it cannot bind the port)."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ValueError(f"--tls-cert {cert} with --tls-key {key}: {exc.reason or exc}") from exc


def server_credentials(cert: str | None, key: str | None, ca: str | None = None) -> grpc.ServerCredentials | None:
    """TLS with the certificate `cert` and its key (None: plaintext); with `ca`, clients must also present a
    certificate that CA signed (mTLS)."""
    if not cert and not key:
        if ca:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key: the server's own certificate and key")
        return None
    if not cert or not key:
        raise ValueError("--tls-cert and --tls-key go together: give both, or neither for plaintext")
    pair = (read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))
    root = read_pem(ca, "--tls-ca") if ca else None
    check_pair(cert, key)
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)


def worker_credentials(cert: str | None, key: str | None, ca: str | None) -> grpc.ServerCredentials | None:
    """A worker's credentials: mTLS, so all three files or none (a worker serves only its coordinator)."""
    given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
    missing = [flag for flag, path in given.items() if not path]
    if len(missing) in (1, 2):
        raise ValueError(
            f"a worker's TLS is mutual: give --tls-cert, --tls-key and --tls-ca together (missing {', '.join(missing)})"
        )
    return server_credentials(cert, key, ca)


@dataclass(frozen=True)
class ClientTls:
    """How a client dials a TLS server: the credentials, and the name its certificate must carry where that is
    not the host dialled (`--tls-server-name`)."""

    credentials: grpc.ChannelCredentials
    server_name: str | None = None

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def client_tls(
    ca: str | None, cert: str | None = None, key: str | None = None, server_name: str | None = None
) -> ClientTls | None:
    """TLS that verifies the server with the CA `ca` (None: plaintext), presenting `cert` and `key` as the client's
    certificate where given (mTLS)."""
    if not ca:
        return None
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together: give both")
    if cert and key:
        check_pair(cert, key)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, "--tls-ca"),
        private_key=read_pem(key, "--tls-key") if key else None,
        certificate_chain=read_pem(cert, "--tls-cert") if cert else None,
    )
    return ClientTls(credentials, server_name)


def coordinator_worker_tls(
    ca: str | None, cert: str | None, key: str | None, server_name: str | None
) -> ClientTls | None:
    """The coordinator's mTLS to its workers: with `ca`, its own certificate is its client certificate."""
    if ca and not (cert and key):
        raise ValueError(
            "--tls-ca (mTLS to the workers) needs --tls-cert and --tls-key: the coordinator's certificate, which "
            "it presents to the workers as its client certificate"
        )
    return client_tls(ca, cert, key, server_name)


def aio_channel(
    address: str,
    tls: ClientTls | None,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=list(interceptors))
    return grpc.aio.secure_channel(
        address, tls.credentials, options=[*options, *tls.options()], interceptors=list(interceptors)
    )


def sync_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.credentials, options=[*options, *tls.options()])


def bearer_metadata(api_key: str | None) -> list[tuple[str, str]]:
    """The call metadata that carries `api_key` (none without one)."""
    return [("authorization", f"Bearer {api_key}")] if api_key else []


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key of `--api-key` or of the file `--api-key-file` names (its first line); None: no auth."""
    if api_key and api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if api_key_file:
        try:
            lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {api_key_file}: cannot read it ({exc})") from exc
        api_key = lines[0].strip() if lines else ""
        if not api_key:
            raise ValueError(f"--api-key-file {api_key_file}: the file is empty")
    if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
        raise ValueError("--api-key: the key is empty or starts or ends with spaces")
    return api_key or None


def bearer_matches(header: str | bytes | None, api_key: str) -> bool:
    """Whether an `authorization` header carries `api_key`, compared in constant time (no timing oracle)."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, given = (header or "").partition(" ")
    ok = hmac.compare_digest(given.strip().encode(), api_key.encode())
    return ok and scheme.lower() == "bearer"


class BearerAuth(grpc.aio.ServerInterceptor):
    """Calls without `authorization: Bearer <api_key>` end with UNAUTHENTICATED before their request is parsed;
    health and reflection stay open."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key
        # Keyed by the server's own methods alone: a name it does not serve gets None, and is never kept.
        self._refusals: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if method.lstrip("/").split("/", 1)[0] in OPEN_SERVICES:
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata or ()  # type: ignore[attr-defined]
        header = next((value for name, value in metadata if name == "authorization"), None)
        if bearer_matches(header, self.api_key):
            return await continuation(handler_call_details)
        refusal = self._refusals.get(method)
        if refusal is None:
            refusal = _refusal(await continuation(handler_call_details))
            if refusal is not None:
                self._refusals[method] = refusal
        return refusal


def _refusal(handler: grpc.RpcMethodHandler[Any, Any] | None) -> grpc.RpcMethodHandler[Any, Any] | None:
    """A handler of `handler`'s kind that ends the call with UNAUTHENTICATED and never parses its request."""
    if handler is None:
        return None

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    def unread(data: bytes) -> None:
        return None

    kind = (handler.request_streaming, handler.response_streaming)
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    return make(refuse, unread, handler.response_serializer)  # type: ignore[operator]
