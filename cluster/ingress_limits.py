"""`IngressLimits`: the bounds the OpenAI ingress puts on what one client may send, so that no request's size
blocks the event loop every other client shares (issue 27).

Plain values, one field each, their defaults the one source of `ServeConfig`'s `# ingress limits` block (the
serve YAML's keys of the same names); `ServeConfig.ingress_limits()` gives the deployment's. Each refusal names
its field, so a client (or an operator reading the log) knows which bound it met:

    max_request_body_bytes    413 beyond it, read or announced (cluster/api/body_limit.py)
    max_stop_sequences        400 naming `stop` (or `stop_token_ids`, bounded alike): each stop string is
                              searched for at every generated token, each stop id looked up
    max_stop_sequence_chars   400 naming `stop`: ... and held back while the text ends with a prefix of it
    max_logit_bias_entries    400 naming `logit_bias`: each entry is applied to every step's logits
    header_timeout_seconds    408 and close: a connection's request headers, from its start or its last response
    keep_alive_timeout_seconds  an idle keep-alive connection is closed (uvicorn's timeout_keep_alive)
    max_connections           503 and close at once for a connection beyond it (cluster/api/connection_guard.py)
    max_header_bytes          431 and close: request line and headers, at most this many bytes
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IngressLimits:
    max_request_body_bytes: int = 32 * 2**20
    """A fixed bound, not one derived from the context: a body also carries tools, schemas and JSON escapes
    (6 bytes a character), and a prompt too long for the context is refused before it is tokenized anyway."""
    max_stop_sequences: int = 32
    max_stop_sequence_chars: int = 256
    max_logit_bias_entries: int = 1024
    header_timeout_seconds: float = 10.0
    keep_alive_timeout_seconds: float = 5.0
    max_connections: int = 2048
    max_header_bytes: int = 64 * 2**10

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
