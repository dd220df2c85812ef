"""`k3serve serve` configuration: flags and/or a YAML file, validated once, here.

YAML keys are the long flag names with dashes as underscores (`prefill_replicas: 2`); flags given
on the command line win over the file. Cross-checks that would otherwise fail deep inside a
worker (a transfer backend without its package, 'local' transfer across processes) fail here
with the field's name; a TP size that does not divide the model's KDA heads fails at startup
(`cluster.serve._check_tp`), once the checkpoint's config is known.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from k3serve.cluster.ingress_limits import IngressLimits
from k3serve.cluster.room_watch import STALL_SECONDS
from k3serve.engine.host_ip import check_host_ip

# The admission queue's default length, in rounds of the decode pool (decode_replicas x max_num_seqs):
# a request queued k rounds deep waits about k request lifetimes, so at 8 rounds of few-second requests
# it already nears queue_timeout_seconds; a longer queue would turn immediate 503s into timed-out ones.
# 8 rounds still absorb a benchmark's burst of 9x the slots (guidellm at concurrency 576 on one 64-slot
# replica) that the colocated engine would serve.
QUEUE_ROUNDS = 8

# Where `ServeConfig.load` finds the API key when neither the file nor a flag gives one: a secret need not
# sit in a YAML file or on a command line (which `ps` shows); a Kubernetes Secret arrives this way.
API_KEY_ENV = "K3SERVE_API_KEY"

_LIMITS = IngressLimits()  # the defaults of the ingress limits (cluster/ingress_limits.py)


class ServeConfig(BaseModel):
    # hide_input_in_errors: pydantic would echo the input (the api_key included) in any field's or
    # cross-check's error, which `k3serve serve` prints; the messages name the field and the rule.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    model: str = Field("k3-tiny", description="checkpoint directory, or a small preset written once and served")
    mode: Literal["disaggregated", "colocated"] = Field("disaggregated", description="separate prefill/decode pools, or one engine")
    transfer: Literal["mooncake", "nixl", "local"] = Field(
        "mooncake", description="how prefill state reaches decode; 'local' needs the in-process launcher"
    )
    launcher: Literal["ray", "local"] = Field("ray", description="Ray actors (pools with restarts) or in-process workers")
    prefill_replicas: int = Field(1, ge=1, description="prefill engines")
    decode_replicas: int = Field(1, ge=1, description="decode engines")
    prefill_tp: int = Field(1, ge=1, description="tensor-parallel ranks per prefill engine")
    decode_tp: int = Field(1, ge=1, description="tensor-parallel ranks per decode engine")
    host: str = Field("127.0.0.1", description="ingress bind address")
    port: int = Field(8000, ge=0, le=65535, description="ingress port (0 = any free port, printed at start)")
    served_model_name: str | None = Field(None, description="model id clients use; default: preset or directory name")
    block_size: int = Field(64, ge=1, description="tokens per MLA KV block (and KDA checkpoint granularity)")
    max_model_len: int = Field(4096, ge=2, description="prompt + output tokens per request")
    max_num_seqs: int = Field(64, ge=1, description="running requests per engine")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="base token budget per step (adaptive above it)")
    cache_memory_bytes: int | None = Field(None, gt=0, description="CPU: bytes for MLA blocks + KDA slots per engine")
    device: str = Field("cpu", description="'cpu' or 'cuda'")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    seed: int = Field(0, description="weights seed of a preset checkpoint; engine RNG seed")
    lease_seconds: float = Field(30.0, gt=0, description="longest a reservation or pinned state waits for its handoff")
    max_queued_requests: int | None = Field(
        None, ge=0, description="disaggregated: requests the ingress holds while no decode replica has room; "
        f"more get 503 at once (0: never wait); default {QUEUE_ROUNDS} x decode_replicas x max_num_seqs",
    )
    queue_timeout_seconds: float = Field(
        60.0, gt=0, description="disaggregated: longest a request waits for decode room, then 503 (a client "
        "gets an answer it can retry well before common client timeouts, e.g. the OpenAI SDK's 600 s)",
    )
    reasoning_parser: Literal["kimi", "none"] = Field(
        "kimi", description="chat: 'kimi' returns a thinking model's <think> block as reasoning_content, apart from "
        "content (as vLLM's --reasoning-parser kimi_k2); it acts only on output with the think markers, so a model "
        "that never thinks is served as with 'none', which returns the text as generated",
    )
    api_key: SecretStr | None = Field(
        None, description="clients must send `Authorization: Bearer <key>` on every /v1 route (/health and /metrics "
        f"stay open); default: ${API_KEY_ENV}, else no key (as vLLM's --api-key / $VLLM_API_KEY)",
    )
    drain_timeout_seconds: float = Field(
        30.0, ge=0, description="on SIGTERM/SIGINT: new requests get 503 and /health 503 at once; those in flight "
        "run on up to this long, then are aborted (a stream ends with an error event); a second signal aborts at "
        "once. Keep it below the pod's terminationGracePeriodSeconds (0: abort at once)",
    )
    verify_checksums: bool = Field(True, description="decode verifies every handoff's checksums before continuing")
    ray_address: str | None = Field(None, description="join this Ray cluster; default: start a local one")
    advertise_host: str | None = Field(
        None, description="IP every Ray worker binds its servers on and advertises to peers (one node only); "
        "default: $K3SERVE_HOST_IP of the worker's node, else Ray's node IP (cluster/node_address.py)",
    )
    # ingress limits
    max_request_body_bytes: int = Field(
        _LIMITS.max_request_body_bytes, gt=0, description="a request body beyond it gets 413, unread")
    max_stop_sequences: int = Field(
        _LIMITS.max_stop_sequences, gt=0, description="stop strings a request may give (and stop_token_ids)")
    max_stop_sequence_chars: int = Field(
        _LIMITS.max_stop_sequence_chars, gt=0, description="characters of one stop string")
    max_logit_bias_entries: int = Field(
        _LIMITS.max_logit_bias_entries, gt=0, description="logit_bias entries a request may give")
    header_timeout_seconds: float = Field(
        _LIMITS.header_timeout_seconds, gt=0, description="a connection whose request headers take longer (from its "
        "start or its last response) gets 408 and is closed")
    keep_alive_timeout_seconds: float = Field(
        _LIMITS.keep_alive_timeout_seconds, gt=0, description="an idle keep-alive connection is closed after it")
    max_connections: int = Field(
        _LIMITS.max_connections, gt=0, description="open connections to the ingress; one more gets 503 and is closed")
    max_header_bytes: int = Field(
        _LIMITS.max_header_bytes, gt=0, description="request line and headers; more gets 431 and the connection closed")
    admission_stall_seconds: float = Field(
        STALL_SECONDS, gt=0, description="disaggregated: a decode replica whose room has been held this long by "
        "reservations that do not move (none handed off, nothing admitted) cannot admit work: /health is 503 "
        "(degraded) while every one is so, and replicas_healthy does not count it")

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, key: SecretStr | None) -> SecretStr | None:
        """A key no client can send fails here, not as every request's 401 (the message never shows the key)."""
        if key is None:
            return None
        value = key.get_secret_value()
        if not value:
            raise ValueError(f"is empty: give a key, or unset it (and ${API_KEY_ENV}) to serve without one")
        if value != value.strip():
            raise ValueError("has leading or trailing white space, which no Authorization header carries (a "
                             "Secret made with `echo` keeps its newline: use `echo -n` or --from-literal)")
        if not value.isascii() or not value.isprintable():
            raise ValueError("must be printable ASCII: an HTTP header carries nothing else")
        return key

    @model_validator(mode="after")
    def _cross_check(self) -> "ServeConfig":
        if self.mode == "disaggregated" and self.transfer == "local" and self.launcher == "ray":
            raise ValueError("transfer 'local' moves bytes inside one process: use --launcher local, or mooncake / nixl")
        if self.mode == "colocated" and self.prefill_tp != 1:
            raise ValueError("colocated mode runs one engine with prefill_tp=1")
        if self.mode == "colocated" and self.decode_tp != 1:
            raise ValueError("colocated mode runs one engine with decode_tp=1")
        if self.mode == "disaggregated" and max(self.prefill_tp, self.decode_tp) > 1 and self.transfer == "local":
            raise ValueError("prefill_tp or decode_tp > 1 runs ranks in separate processes: use transfer mooncake or nixl")
        queue_fields = {"max_queued_requests", "queue_timeout_seconds",
                        "admission_stall_seconds"} & self.model_fields_set
        if self.mode == "colocated" and queue_fields:
            raise ValueError(f"{', '.join(sorted(queue_fields))}: the disaggregated ingress's admission queue; "
                             "colocated mode queues in its engine's scheduler")
        if self.advertise_host is not None:
            check_host_ip(self.advertise_host, "advertise_host")
            if self.mode == "colocated" or self.launcher == "local":
                raise ValueError("advertise_host is for disaggregated serving with --launcher ray: colocated and "
                                 "local-launcher workers share one machine and talk over 127.0.0.1")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "ServeConfig":
        """File values, then `overrides` (flags that were given; None means not given); then, when neither
        gives an api_key, $K3SERVE_API_KEY (as vLLM: `--api-key`, else $VLLM_API_KEY)."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: a serve config is a mapping of option: value")
            data.update(loaded)
        data.update({k: v for k, v in overrides.items() if v is not None})
        if data.get("api_key") is None and API_KEY_ENV in os.environ:
            data["api_key"] = os.environ[API_KEY_ENV]
        return cls(**data)

    @property
    def queue_capacity(self) -> int:
        """max_queued_requests, or its default: QUEUE_ROUNDS rounds of the decode pool's running slots."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUE_ROUNDS * self.decode_replicas * self.max_num_seqs

    def ingress_limits(self) -> IngressLimits:
        """The `# ingress limits` fields, as the ingress takes them."""
        return IngressLimits(**{name: getattr(self, name) for name in IngressLimits.__dataclass_fields__})

    def engine_kwargs(self) -> dict[str, Any]:
        """EngineArgs of every engine in the deployment."""
        keys = ("model", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "cache_memory_bytes", "device", "dtype", "seed", "served_model_name")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
