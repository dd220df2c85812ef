"""`k3serve serve` configuration: flags and/or a YAML file, validated once, here.

YAML keys are the long flag names with dashes as underscores (`prefill_replicas: 2`); flags given
on the command line win over the file. The engine arguments are EngineArgs' own fields, generated
from them (names, types, defaults, descriptions): one value for the deployment, and for the
`POOL_ENGINE_ARGS` a `prefill_*` / `decode_*` form over it (`ServeConfig.engine_args(pool)`).
Cross-checks that would otherwise fail deep inside a worker (a transfer backend without its
package, 'local' transfer across processes, a pool's contradictory engine arguments) fail here
with the field's name; a TP size that does not divide the model's KDA heads fails at startup
(`cluster.serve._check_tp`), once the checkpoint's config is known. Each pool's autoscaling fields
(`{pool}_max_replicas` turns it on; `AutoscaleOptions`) are checked together and against `{pool}_replicas`
(`autoscaling(pool)` is the pool's rule, docs/design/autoscaling.md). Design: docs/design/serve_config.md.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal, get_type_hints

import yaml
from pydantic import ConfigDict, Field, SecretStr, create_model, field_validator, model_validator

from k3serve.engine.config import EngineArgs, engine_arg_docs
from k3serve.cluster.autoscaling import SIGNALS, PoolAutoscaling
from k3serve.cluster.ingress_limits import IngressLimits
from k3serve.cluster.room_watch import STALL_SECONDS
from k3serve.engine.host_ip import check_host_ip
from k3serve.transfer.auth import check_secret

# The admission queue's default length, in rounds of the decode pool (decode_replicas x its max_num_seqs):
# a request queued k rounds deep waits about k request lifetimes, so at 8 rounds of few-second requests
# it already nears queue_timeout_seconds; a longer queue would turn immediate 503s into timed-out ones.
# 8 rounds still absorb a benchmark's burst of 9x the slots (guidellm at concurrency 576 on one 64-slot
# replica) that the colocated engine would serve.
QUEUE_ROUNDS = 8

# Where `ServeConfig.load` finds the API key when neither the file nor a flag gives one: a secret need not
# sit in a YAML file or on a command line (which `ps` shows); a Kubernetes Secret arrives this way.
API_KEY_ENV = "K3SERVE_API_KEY"
# The same for the secret of the internal control plane, which every worker of a multi-node deployment must share.
INTERNAL_SECRET_ENV = "K3SERVE_INTERNAL_SECRET"

_LIMITS = IngressLimits()  # the defaults of the ingress limits (cluster/ingress_limits.py)

Pool = Literal["prefill", "decode", "colocated"]
POOLS = ("prefill", "decode")
# EngineArgs' fields by reach (tensor_parallel_size aside: prefill_tp / decode_tp). One value for every engine of
# the deployment: the model, and what the handoff needs alike on both sides (cache layout: dtype, device,
# block_size) and the router checks once (max_model_len).
DEPLOYMENT_ENGINE_ARGS = ("model", "served_model_name", "model_cache_dir", "seed", "device", "dtype", "block_size",
                          "max_model_len")
# A shared value, and a prefill_* / decode_* form over it for one pool.
POOL_ENGINE_ARGS = ("max_num_seqs", "max_num_batched_tokens", "max_adaptive_batched_tokens",
                    "long_prefill_token_threshold", "enable_prefix_caching", "kda_checkpoint_mode",
                    "adaptive_token_budget", "kernels", "moe_finalize", "cache_memory_bytes", "gpu_memory_utilization",
                    "num_kda_slots", "num_gpu_blocks_override", "kv_events_config", "kv_offload",
                    "kv_offload_host_bytes", "kv_offload_mooncake_config")
# Decode steps' CUDA graphs: the decode pool's and a colocated engine's; a prefill engine runs no decode step, so it
# is always eager (capturing would cost time and memory for nothing).
# Decode context parallelism likewise: a prefill engine holds whole blocks and the handoff sends each decode rank
# its pages (transfer/tp_map.py).
DECODE_ENGINE_ARGS = ("enforce_eager", "cuda_graph_batch_sizes", "speculative_config", "decode_context_parallel_size")
_DECODE_NOTES = {"enforce_eager": " Serving: the decode pool's (prefill engines are always eager).",
                 "cuda_graph_batch_sizes": " Serving: the decode pool's (prefill engines are always eager).",
                 "speculative_config": "",  # its own docstring says where it applies
                 "decode_context_parallel_size": " Serving: the decode pool's, dividing decode_tp (prefill engines "
                                                 "hold whole blocks; each decode rank receives its pages)."}


def _engine_fields() -> dict[str, Any]:
    """Pydantic fields of the engine arguments: each shared one as EngineArgs declares it (type, default, its
    docstring as the description), then the per-pool forms, None meaning the shared value."""
    hints, docs = get_type_hints(EngineArgs), engine_arg_docs()
    defaults = {f.name: f.default for f in fields(EngineArgs) if f.default is not MISSING}
    notes = _DECODE_NOTES
    shared = {name: (hints[name], Field(defaults[name], description=docs[name] + notes.get(name, "")))
              for name in DEPLOYMENT_ENGINE_ARGS + POOL_ENGINE_ARGS + DECODE_ENGINE_ARGS}
    per_pool = {f"{pool}_{name}": (hints[name] | None, Field(None, description=f"the {pool} pool's {name}; "
                                                                f"unset: {name}'s value"))
                for pool in POOLS for name in POOL_ENGINE_ARGS}
    return shared | per_pool


EngineOptions = create_model("EngineOptions", __module__=__name__, **_engine_fields())
EngineOptions.__doc__ = "ServeConfig's engine arguments, generated from EngineArgs' fields (`_engine_fields`)."


def _autoscale_fields() -> dict[str, Any]:
    """Each pool's autoscaling fields (cluster/autoscaling.py): `{pool}_max_replicas` set turns it on."""
    out: dict[str, Any] = {}
    for pool in POOLS:
        signal = Literal[SIGNALS[pool]]  # type: ignore[valid-type]
        out |= {
            f"{pool}_min_replicas": (int | None, Field(None, ge=1, description=f"autoscaling: the fewest {pool} "
                                                       f"replicas; unset: {pool}_replicas")),
            f"{pool}_max_replicas": (int | None, Field(None, ge=1, description=f"autoscaling: the most {pool} "
                                                       f"replicas; set, the {pool} pool autoscales from "
                                                       f"{pool}_replicas on {pool}_autoscale_signal")),
            f"{pool}_autoscale_signal": (signal, Field(SIGNALS[pool][0], description=f"autoscaling: the {pool} "
                                                       "pool's load, per replica: "
                                                       + ", ".join(SIGNALS[pool]))),
            f"{pool}_autoscale_target": (float | None, Field(None, gt=0, description=f"autoscaling: the "
                                                             f"{pool}_autoscale_signal each replica is sized for "
                                                             "(a *_usage signal: a ratio up to 1); required with "
                                                             f"{pool}_max_replicas")),
            f"{pool}_scale_up_delay_seconds": (float, Field(30.0, ge=0, description=f"autoscaling: how long more "
                                                            f"{pool} replicas must be wanted before one is added")),
            f"{pool}_scale_down_delay_seconds": (float, Field(300.0, ge=0, description=f"autoscaling: how long "
                                                              f"fewer {pool} replicas must be wanted before one "
                                                              "drains and stops")),
        }
    return out


AutoscaleOptions = create_model("AutoscaleOptions", __base__=EngineOptions, __module__=__name__, **_autoscale_fields())
AutoscaleOptions.__doc__ = "ServeConfig's autoscaling fields, a set for each pool (`_autoscale_fields`)."


class ServeConfig(AutoscaleOptions):
    """What `k3serve serve` runs: the engine arguments (`EngineOptions`), then the deployment's own fields."""

    # hide_input_in_errors: pydantic would echo the input (the api_key included) in any field's or
    # cross-check's error, which `k3serve serve` prints; the messages name the field and the rule.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

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
    lease_seconds: float = Field(30.0, gt=0, description="longest a reservation or pinned state waits for its handoff")
    max_queued_requests: int | None = Field(
        None, ge=0, description="disaggregated: requests the ingress holds while no decode replica has room; "
        f"more get 503 at once (0: never wait); default {QUEUE_ROUNDS} x decode_replicas x the decode pool's "
        "max_num_seqs",
    )
    queue_timeout_seconds: float = Field(
        60.0, gt=0, description="disaggregated: longest a request waits for decode room, then 503 (a client "
        "gets an answer it can retry well before common client timeouts, e.g. the OpenAI SDK's 600 s)",
    )
    reasoning_parser: Literal["auto", "kimi", "kimi_k2", "kimi_k3", "none"] = Field(
        "auto", description="chat: the parser that returns a thinking model's reasoning as `reasoning` apart from "
        "content, as vLLM's --reasoning-parser: 'kimi_k2' (<think> blocks), 'kimi_k3' (K3's XTML think channel), "
        "'none' (the text as generated); 'auto' (or 'kimi') picks the checkpoint's format from its tokenizer",
    )
    tool_call_parser: Literal["auto", "kimi_k2", "kimi_k3"] = Field(
        "auto", description="chat: the parser of the model's tool calls, as vLLM's --tool-call-parser: 'kimi_k2' "
        "(<|tool_call_begin|> markers), 'kimi_k3' (K3's XTML tools channel); 'auto' picks the checkpoint's format",
    )
    enable_auto_tool_choice: bool = Field(
        True, description="chat: serve tool_choice 'auto' (the model decides to call tools), as vLLM's "
        "--enable-auto-tool-choice; off, a request with tools and tool_choice 'auto' is a 400",
    )
    api_key: SecretStr | None = Field(
        None, description="clients must send `Authorization: Bearer <key>` on every /v1 route (/health and /metrics "
        f"stay open); default: ${API_KEY_ENV}, else no key (as vLLM's --api-key / $VLLM_API_KEY)",
    )
    drain_timeout_seconds: float = Field(
        30.0, ge=0, description="on SIGTERM/SIGINT: new requests get 503 and /health 503 at once; those in flight "
        "run on up to this long, then are aborted (a stream ends with an error event); a second signal aborts at "
        "once. Keep it below the pod's terminationGracePeriodSeconds (0: abort at once). Autoscaling: how long a "
        "replica chosen for removal waits for its requests to end",
    )
    legacy_metric_names: bool = Field(
        False, description="/metrics also exports the families under the k3serve: names they had before taking "
        "vLLM's (k3serve:time_to_first_token_seconds, ...; cluster/metrics.py LEGACY_NAMES); for one release",
    )
    verify_checksums: bool = Field(True, description="decode verifies every handoff's checksums before continuing")
    reverify_probability: float = Field(
        0.0, ge=0.0, le=1.0, description="decode: the chance per step that an adopted request's prompt KV is "
        "checksummed again (state changed behind the engine fails the request); 0: only before its first step",
    )
    internal_secret: SecretStr | None = Field(
        None, description="the secret every internal control-plane call carries (prefill -> decode gRPC); "
        f"default: ${INTERNAL_SECRET_ENV}, else a new one at every start (fine on one node or one Ray cluster "
        "started here; workers on several nodes that join by other means must share one)",
    )
    migrate_on_decode_failure: bool = Field(
        True, description="a stream whose decode replica dies continues on another one (the prompt and the tokens "
        "already sent are prefilled again; docs/design/migration.md); off: it ends with a clean 503 error")
    ray_address: str | None = Field(None, description="join this Ray cluster; default: start a local one")
    ray_dashboard: bool = Field(False, description="the local Ray's dashboard on http://127.0.0.1:8265, with Ray's "
                                "autoscaler and log monitors (off: none of the three, ~300 MB less)")
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

    internal_tls_dir: str | None = Field(
        None, description="directory of ca.crt, tls.crt and tls.key on every node (a mounted cert-manager Secret): "
        "the internal control plane then runs over mutual TLS, each worker with its own node's certificate "
        "(for its pod IP), the secret still checked; default: plain TCP",
    )

    @field_validator("internal_secret")
    @classmethod
    def _usable_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None:
            check_secret(secret.get_secret_value(), "internal_secret")
        return secret

    @model_validator(mode="after")
    def _cross_check(self) -> "ServeConfig":
        if self.mode == "disaggregated" and self.transfer == "local" and self.launcher == "ray":
            raise ValueError("transfer 'local' moves bytes inside one process: use --launcher local, or mooncake / nixl")
        if self.mode == "colocated" and self.prefill_tp != 1:
            raise ValueError("colocated mode runs one engine with prefill_tp=1")
        if self.mode == "colocated" and self.decode_tp != 1:
            raise ValueError("colocated mode runs one engine with decode_tp=1")
        dcp = self.decode_context_parallel_size
        if dcp < 1 or self.decode_tp % dcp:
            raise ValueError(f"decode_context_parallel_size={dcp} must be >= 1 and divide decode_tp={self.decode_tp}: "
                             "a DCP group is that many of a decode engine's ranks")
        if self.mode == "disaggregated" and max(self.prefill_tp, self.decode_tp) > 1 and self.transfer == "local":
            raise ValueError("prefill_tp or decode_tp > 1 runs ranks in separate processes: use transfer mooncake or nixl")
        queue_fields = {"max_queued_requests", "queue_timeout_seconds",
                        "admission_stall_seconds"} & self.model_fields_set
        if self.mode == "colocated" and queue_fields:
            raise ValueError(f"{', '.join(sorted(queue_fields))}: the disaggregated ingress's admission queue; "
                             "colocated mode queues in its engine's scheduler")
        overrides = {pool: [f"{pool}_{name}={value!r}" for name in POOL_ENGINE_ARGS
                            if (value := getattr(self, f"{pool}_{name}")) is not None] for pool in POOLS}
        if self.mode == "colocated" and (given := overrides["prefill"] + overrides["decode"]):
            raise ValueError(f"{', '.join(given)}: colocated mode runs one engine: set the shared key (without the "
                             "pool's prefix)")
        for pool in self.pools:
            try:
                self.engine_args(pool)
            except ValueError as e:
                given = ", ".join(overrides.get(pool, ())) or "the shared values"
                raise ValueError(f"the {pool} pool's engine arguments ({given}): {e}") from None
        if self.ray_dashboard and (self.mode == "colocated" or self.launcher == "local" or self.ray_address):
            raise ValueError("ray_dashboard is the dashboard of the local Ray that --launcher ray starts (a joined "
                             "cluster has its own)")
        for pool in POOLS:
            self._check_autoscaling(pool)
        if self.advertise_host is not None:
            check_host_ip(self.advertise_host, "advertise_host")
            if self.mode == "colocated" or self.launcher == "local":
                raise ValueError("advertise_host is for disaggregated serving with --launcher ray: colocated and "
                                 "local-launcher workers share one machine and talk over 127.0.0.1")
        return self

    def _check_autoscaling(self, pool: str) -> None:
        """A pool's autoscaling fields agree with each other and its replica count (each error names its field)."""
        given = sorted(name for name in self.model_fields_set if name.startswith(f"{pool}_")
                       and name.removeprefix(f"{pool}_") in ("min_replicas", "autoscale_signal", "autoscale_target",
                                                            "scale_up_delay_seconds", "scale_down_delay_seconds"))
        maximum, replicas = getattr(self, f"{pool}_max_replicas"), getattr(self, f"{pool}_replicas")
        if maximum is None:
            if given:
                raise ValueError(f"{', '.join(given)}: set {pool}_max_replicas to autoscale the {pool} pool")
            return
        if self.mode == "colocated":
            raise ValueError(f"{pool}_max_replicas: colocated mode runs one engine, which does not autoscale")
        if getattr(self, f"{pool}_autoscale_target") is None:
            raise ValueError(f"{pool}_autoscale_target: required with {pool}_max_replicas")
        rule = self.autoscaling(pool)
        assert rule is not None
        if rule.signal.endswith("_usage") and rule.target > 1:
            raise ValueError(f"{pool}_autoscale_target={rule.target:g}: {rule.signal} is a ratio: give at most 1")
        if not rule.min_replicas <= replicas <= rule.max_replicas:
            raise ValueError(f"{pool}_replicas={replicas}: starts between {pool}_min_replicas={rule.min_replicas} "
                             f"and {pool}_max_replicas={rule.max_replicas}")

    def autoscaling(self, pool: str) -> PoolAutoscaling | None:
        """`pool`'s autoscaling rule; None when its size is fixed ({pool}_max_replicas unset)."""
        maximum = getattr(self, f"{pool}_max_replicas", None)
        if maximum is None:
            return None
        field = lambda name: getattr(self, f"{pool}_{name}")  # noqa: E731
        minimum = field("min_replicas") if field("min_replicas") is not None else min(field("replicas"), maximum)
        return PoolAutoscaling(pool, field("autoscale_signal"), field("autoscale_target"), minimum, maximum,
                               field("scale_up_delay_seconds"), field("scale_down_delay_seconds"))

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "ServeConfig":
        """File values, then `overrides` (flags that were given; None means not given); then, when neither
        gives an api_key, $K3SERVE_API_KEY (as vLLM: `--api-key`, else $VLLM_API_KEY); the same for
        internal_secret and $K3SERVE_INTERNAL_SECRET."""
        data: dict[str, Any] = {}
        if path is not None:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: a serve config is a mapping of option: value")
            data.update(loaded)
        data.update({k: v for k, v in overrides.items() if v is not None})
        if data.get("api_key") is None and API_KEY_ENV in os.environ:
            data["api_key"] = os.environ[API_KEY_ENV]
        if data.get("internal_secret") is None and INTERNAL_SECRET_ENV in os.environ:
            data["internal_secret"] = os.environ[INTERNAL_SECRET_ENV]
        return cls(**data)

    @property
    def pools(self) -> tuple[Pool, ...]:
        """The engine pools this deployment runs."""
        return ("colocated",) if self.mode == "colocated" else POOLS

    @property
    def queue_capacity(self) -> int:
        """max_queued_requests, or its default: QUEUE_ROUNDS rounds of the decode pool's running slots."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return QUEUE_ROUNDS * self.decode_replicas * self.engine_args("decode").max_num_seqs

    def engine_args(self, pool: Pool) -> EngineArgs:
        """The EngineArgs of each engine of `pool` (in colocated mode, the one engine): the shared values, the pool's
        own `{pool}_*` ones over them, the pool's TP size; a prefill engine eager (DECODE_ENGINE_ARGS). Raises
        ValueError for a contradictory set (validation calls it for every pool the deployment runs)."""
        values = {name: getattr(self, name) for name in DEPLOYMENT_ENGINE_ARGS + POOL_ENGINE_ARGS}
        if pool in POOLS:
            values.update({name: value for name in POOL_ENGINE_ARGS
                           if (value := getattr(self, f"{pool}_{name}")) is not None})
        if pool == "prefill":
            values["enforce_eager"] = True
        else:
            values.update({name: getattr(self, name) for name in DECODE_ENGINE_ARGS})
        tp = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(pool, 1)
        return EngineArgs(**values, tensor_parallel_size=tp)

    def ingress_limits(self) -> IngressLimits:
        """The `# ingress limits` fields, as the ingress takes them."""
        return IngressLimits(**{name: getattr(self, name) for name in IngressLimits.__dataclass_fields__})
