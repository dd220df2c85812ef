"""The deployment's control-plane secret: every `DecodeControl` call carries it, every server checks it first.

    client (DecodeControlClient)                       server (DecodeControlServer)
    metadata  k3serve-control-secret: <secret>  --->   SecretCheck: constant-time compare, before any handler;
                                                <---   wrong or missing: UNAUTHENTICATED, one fixed message

A refused call learns nothing: no compat hash, no instance id, no region (the handler never runs). The secret is
one per deployment: `cluster/serve.py` generates it at start (`new_secret`), or takes `internal_secret` from the
config / `$K3SERVE_INTERNAL_SECRET` (a Kubernetes Secret) when the workers of several nodes must share it; workers
built without one (tests, in-process tools) share this process's own (`process_secret`). The secret is a bearer
token over plain TCP: multi-node, run the channel over mTLS (docs/design/control_plane.md, "Authentication").
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from typing import Any

import grpc

__all__ = ["METADATA_KEY", "MIN_SECRET_LENGTH", "REFUSAL", "SecretCheck", "check_secret", "new_secret",
           "process_secret"]

METADATA_KEY = "k3serve-control-secret"  # gRPC metadata keys are lower case
MIN_SECRET_LENGTH = 16
REFUSAL = "DecodeControl: missing or wrong deployment secret"  # the same words for every refused call

_PROCESS_SECRET = secrets.token_urlsafe(32)


def new_secret() -> str:
    """A fresh deployment secret (256 random bits, URL-safe text: a valid gRPC metadata value)."""
    return secrets.token_urlsafe(32)


def process_secret() -> str:
    """This process's own secret, for workers built without one: only peers in this process know it."""
    return _PROCESS_SECRET


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
