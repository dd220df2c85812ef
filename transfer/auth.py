"""The deployment's control-plane secret: every `DecodeControl` call carries it, every server checks it first.

    client (DecodeControlClient)                       server (DecodeControlServer)
    metadata  k3serve-control-secret: <secret>  --->   SecretCheck: constant-time compare, before any handler;
                                                <---   wrong or missing: UNAUTHENTICATED, one fixed message

A refused call learns nothing: no compat hash, no instance id, no region (the handler never runs). The secret is
one per deployment: `cluster/serve.py` generates it at start (`new_secret`), or takes `internal_secret` from the
config / `$K3SERVE_INTERNAL_SECRET` (a Kubernetes Secret) when the workers of several nodes must share it; workers
built without one (tests, in-process tools) share this process's own (`process_auth`). The secret is a bearer
token: on plain TCP a host on the path reads it. Multi-node, `ControlTLS` (a directory as cert-manager writes a
certificate Secret: ca.crt, tls.crt, tls.key) runs every call over mutual TLS, the secret still checked inside.
Design: docs/design/control_plane.md, "Authentication and bounds".
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

__all__ = ["METADATA_KEY", "MIN_SECRET_LENGTH", "REFUSAL", "ControlAuth", "ControlTLS", "SecretCheck", "check_secret",
           "new_secret", "process_auth"]

METADATA_KEY = "k3serve-control-secret"  # gRPC metadata keys are lower case
MIN_SECRET_LENGTH = 16
REFUSAL = "DecodeControl: missing or wrong deployment secret"  # the same words for every refused call

_PROCESS_SECRET = secrets.token_urlsafe(32)


def new_secret() -> str:
    """A fresh deployment secret (256 random bits, URL-safe text: a valid gRPC metadata value)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class ControlAuth:
    """How one worker's control plane authenticates (what crosses to its actor or follower process): the
    deployment's secret, and the directory of its mutual-TLS files on the worker's own node, if any."""

    secret: str
    tls_dir: str | None = None

    def __post_init__(self) -> None:
        check_secret(self.secret, "ControlAuth")

    def tls(self) -> "ControlTLS | None":
        """The TLS files, read now (on the worker's node); None: plain TCP."""
        return None if self.tls_dir is None else ControlTLS.from_dir(self.tls_dir)


def process_auth() -> ControlAuth:
    """This process's own secret, no TLS, for workers built without one: only peers in this process know it."""
    return ControlAuth(_PROCESS_SECRET)


def check_secret(secret: str, what: str) -> str:
    """`secret` if usable as a metadata value and long enough to guess at no rate; else ValueError naming `what`
    (never the value)."""
    if len(secret) < MIN_SECRET_LENGTH:
        raise ValueError(f"{what}: the control-plane secret must have at least {MIN_SECRET_LENGTH} characters")
    if not secret.isascii() or not secret.isprintable() or secret != secret.strip():
        raise ValueError(f"{what}: the control-plane secret must be printable ASCII without surrounding white space "
                         "(a gRPC metadata value carries nothing else)")
    return secret


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


class SecretCheck(grpc.ServerInterceptor):
    """Server interceptor: a call whose metadata lacks the secret is answered UNAUTHENTICATED before it reaches
    the servicer. Thread-safe (gRPC's pool threads call it)."""

    def __init__(self, secret: str) -> None:
        self._secret = check_secret(secret, "DecodeControlServer").encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        given = next((value for key, value in details.invocation_metadata or () if key == METADATA_KEY), "")
        given = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given, self._secret):
            return continuation(details)
        return grpc.unary_unary_rpc_method_handler(_refuse)


@dataclass(frozen=True)
class ControlTLS:
    """Mutual TLS for DecodeControl: this rank's certificate chain and key, and the CA every peer's certificate must
    chain to (PEM). A server with it accepts only clients presenting such a certificate; a client checks the server's
    against the CA and its address (the certificate names the pod IP)."""

    root_ca: bytes
    cert_chain: bytes
    private_key: bytes

    @classmethod
    def from_dir(cls, path: str | Path) -> "ControlTLS":
        """ca.crt, tls.crt and tls.key of `path` (a mounted cert-manager Secret); ValueError naming a missing one."""
        files = {name: Path(path) / name for name in ("ca.crt", "tls.crt", "tls.key")}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise ValueError(f"control-plane TLS directory {path}: missing {', '.join(missing)}")
        return cls(*(f.read_bytes() for f in files.values()))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.root_ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.root_ca, private_key=self.private_key,
                                            certificate_chain=self.cert_chain)
