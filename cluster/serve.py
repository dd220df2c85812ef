"""Assemble and run a deployment from a `ServeConfig`: workers, router, OpenAI ingress.

    colocated:       ingress -> AsyncEngine (one engine, both phases; the correctness oracle)
    disaggregated:   ingress -> DisaggregatedRouter -> prefill replicas --state--> decode replicas
                     replicas are Ray actors (`launcher: ray`) or in-process workers (`local`)

`k3serve serve` calls `run(config)`; tests call `start_deployment` / `Deployment.shutdown` and
serve the app themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.node_address import HOST_IP_ENV, LOOPBACK
from k3serve.engine.config import EngineArgs
from k3serve.model.packaged import resolve_model_dir
from k3serve.model.presets import PRESETS
from k3serve.progress import say, stage

log = logging.getLogger(__name__)


@dataclass
class Deployment:
    client: Any  # EngineClient
    metrics: IngressMetrics
    config: ServeConfig
    _stops: list[Callable[[], None]] = field(default_factory=list)
    autoscaler: Any = None  # cluster/autoscaler.py Autoscaler, when a pool autoscales; started in the ingress's loop

    def shutdown(self) -> None:
        """Stop every worker (and Ray, if this deployment started it). Safe to call twice."""
        _run_stops(self._stops)


def _run_stops(stops: list[Callable[[], None]]) -> None:
    """Run and remove every stop, last added first, each whatever the others do."""
    while stops:
        stop = stops.pop()
        try:
            stop()
        except Exception as e:  # keep stopping the rest
            log.warning("shutdown step failed: %r", e)


def start_deployment(config: ServeConfig) -> Deployment:
    """Start the workers (and a local Ray) and the client the ingress serves, printing a line a stage
    (`k3serve.progress`). A start that fails part-way stops what it started."""
    # Write a preset checkpoint once, here, rather than racing in every worker.
    model_dir = str(_model_dir(config))
    name = config.served_model_name or os.path.basename(os.path.normpath(config.model))
    args = {pool: replace(config.engine_args(pool), model=model_dir, served_model_name=name) for pool in config.pools}
    if config.mode == "colocated":
        from k3serve.engine.async_engine import AsyncEngine
        from k3serve.engine.offload.metrics import offload_metrics
        from k3serve.engine.spec.metrics import spec_decode_metrics
        from k3serve.engine.structured_output_metrics import grammar_compile_metrics

        with stage("loading the colocated engine (weights, pools, warm-up)"):
            engine = AsyncEngine(args["colocated"])
        metrics = IngressMetrics(model_name=engine.model_name, max_model_len=config.max_model_len,
                                 legacy_names=config.legacy_metric_names)
        metrics.include(grammar_compile_metrics().collectors)  # the engine compiles in this process
        metrics.watch_engine("colocated", "0", lambda: engine.call(lambda e: e.stats()))
        metrics.include(spec_decode_metrics().collectors)  # and speculates in it
        metrics.include(offload_metrics().collectors)  # and offloads prefix units from it
        return Deployment(engine, metrics, config, [engine.shutdown])
    _check_tp(config, model_dir)
    if config.launcher == "ray":
        return _start_ray(config, args["prefill"], args["decode"])
    return _start_local(config, args["prefill"], args["decode"])


def _model_dir(config: ServeConfig) -> Path:
    """The checkpoint directory `config.model` names; a preset's (written on first use) as a stage of its own."""
    if config.model not in PRESETS:  # a directory or a shipped model, read in place
        return resolve_model_dir(config.model, config.seed, config.model_cache_dir)
    with stage(f"the {config.model} checkpoint (seed {config.seed}, random weights; written once, under "
               f"{config.model_cache_dir})"):
        return resolve_model_dir(config.model, config.seed, config.model_cache_dir)


def _check_tp(config: ServeConfig, model_dir: str) -> None:
    """Both pools shard the KDA heads by their TP size: refuse a size that does not divide them
    here, before any worker starts, rather than deep inside one."""
    from k3serve.model.config import ModelConfig

    heads = ModelConfig.from_dir(model_dir).kda.num_heads
    for field_name, tp in (("prefill_tp", config.prefill_tp), ("decode_tp", config.decode_tp)):
        if heads % tp:
            raise ValueError(f"{field_name}={tp} does not divide the {heads} KDA heads of {config.model}: "
                             "every rank must hold whole heads")


def _worker_kwargs(config: ServeConfig) -> tuple[dict, dict]:
    """The prefill and decode workers' keyword arguments; both carry the deployment's control-plane auth
    (`internal_secret`, else one made now, and `internal_tls_dir`: transfer/auth.py)."""
    from k3serve.transfer.auth import ControlAuth, new_secret

    secret = config.internal_secret.get_secret_value() if config.internal_secret is not None else new_secret()
    auth = ControlAuth(secret, config.internal_tls_dir)
    prefill = {"transfer": config.transfer, "lease_seconds": config.lease_seconds, "control_auth": auth}
    decode = {
        "transfer": config.transfer, "lease_seconds": config.lease_seconds, "prefill_tp": config.prefill_tp,
        "verify_checksums": config.verify_checksums, "reverify_probability": config.reverify_probability,
        "control_auth": auth,
    }
    return prefill, decode


def _router(config: ServeConfig, prefill: list, decode: list, model_dir: str, name: str) -> tuple[Any, IngressMetrics]:
    """The router over the started replicas, whose engines serve the checkpoint `model_dir` as `name`."""
    from k3serve.cluster.router import DisaggregatedRouter
    from k3serve.model.config import ModelConfig
    from k3serve.model.tokenizer import Tokenizer

    metrics = IngressMetrics(model_name=name, max_model_len=config.max_model_len,
                             legacy_names=config.legacy_metric_names)
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab_size = ModelConfig.from_dir(model_dir).vocab_size
    router = DisaggregatedRouter(prefill, decode, tokenizer, name, config.max_model_len, vocab_size, metrics,
                                 max_queued_requests=config.queue_capacity,
                                 queue_timeout_seconds=config.queue_timeout_seconds,
                                 admission_stall_seconds=config.admission_stall_seconds,
                                 migrate_on_decode_failure=config.migrate_on_decode_failure,
                                 block_size=config.block_size,
                                 shared_prefix_store=config.engine_args("prefill").kv_offload == "mooncake")
    return router, metrics


def _start_local(config: ServeConfig, prefill_args: EngineArgs, decode_args: EngineArgs) -> Deployment:
    """Workers in this process; the ranks > 0 of a TP engine (prefill or decode) in child processes,
    watched while they start (`cluster/local_followers.py`). One machine: every address is 127.0.0.1
    (the workers' defaults). A start that fails part-way stops every worker and process started so far."""
    from k3serve.cluster.local_followers import start_tp_engine
    from k3serve.decode import rank as decode_rank
    from k3serve.decode.worker import DecodeWorker
    from k3serve.prefill import rank as prefill_rank
    from k3serve.prefill.worker import PrefillWorker

    from k3serve.cluster.autoscaler import ReplicaLauncher

    prefill_kw, decode_kw = _worker_kwargs(config)

    def start(name: str, tp: int, build: Callable, follower: Callable,
              follower_args: Callable[[int, str], tuple]) -> tuple[Any, Callable[[], None]]:
        """Rank 0's worker `build(group)` of one engine (its followers first when TP > 1), and its stop."""
        if tp == 1:
            worker = build(None)
            return worker, worker.shutdown
        worker, followers = start_tp_engine(name, tp, LOOPBACK, follower, follower_args, build)
        return worker, lambda: _run_stops([followers.stop, worker.shutdown])  # the worker releases them first

    def build(pool: str, name: str) -> tuple[Any, Callable[[], None]]:
        if pool == "prefill":
            return start(name, config.prefill_tp,
                         lambda group: PrefillWorker(prefill_args, name=name, group=group, **prefill_kw),
                         prefill_rank.follower_main,
                         lambda rank, init: (rank, prefill_args, init, config.transfer, None, None, LOOPBACK,
                                             prefill_kw["control_auth"]))
        return start(name, config.decode_tp,
                     lambda group: DecodeWorker(decode_args, name=name, group=group, **decode_kw),
                     decode_rank.follower_main,
                     lambda rank, init: (rank, decode_args, init, config.transfer, LOOPBACK, config.prefill_tp, None,
                                         None, decode_kw["control_auth"]))

    launcher = ReplicaLauncher(build)
    stops: list[Callable[[], None]] = [launcher.stop_all]

    def first(pool: str, count: int) -> list[Any]:
        workers = []
        for i in range(count):
            worker, stop = build(pool, f"{pool}-{i}")
            launcher.adopt(f"{pool}-{i}", stop)
            workers.append(worker)
        return workers

    try:
        with stage(f"starting {_replica_names(config)} (weights, pools, warm-up)"):
            prefill, decode = first("prefill", config.prefill_replicas), first("decode", config.decode_replicas)
            router, metrics = _router(config, prefill, decode, decode_args.model, decode_args.served_model_name)
    except BaseException:
        _run_stops(stops)
        raise
    return Deployment(router, metrics, config, stops, _autoscaler(config, router, metrics, launcher))


def _autoscaler(config: ServeConfig, router: Any, metrics: IngressMetrics, launcher: Any) -> Any:
    """The deployment's Autoscaler over its autoscaled pools (cluster/autoscaler.py); None when no pool autoscales."""
    from k3serve.cluster.autoscaler import Autoscaler

    rules = {pool: rule for pool in config.pools if (rule := config.autoscaling(pool)) is not None}
    if not rules:
        return None
    return Autoscaler(router, rules, launcher, metrics,
                      {"prefill": config.prefill_replicas, "decode": config.decode_replicas},
                      drain_timeout_s=config.drain_timeout_seconds)


def _start_ray(config: ServeConfig, prefill_args: EngineArgs, decode_args: EngineArgs) -> Deployment:
    """Every replica's actors, started together (a replica's name in any error). A start that fails
    part-way kills the actors and removes the placement groups created so far (and Ray, if started
    here): a cluster keeps no GPU or CPU for a deployment that never served."""
    import ray

    from k3serve.cluster.actors import DecodeActor, DecodeRankActor, PrefillActor, PrefillRankActor
    from k3serve.cluster.autoscaler import ReplicaLauncher
    from k3serve.cluster.replicas import RayDecodeReplica, RayPrefillReplica

    stops: list[Callable[[], None]] = []
    single_node = not config.ray_address and not ray.is_initialized()
    if not ray.is_initialized():
        # Ray's token auth stays on (Ray 2.60 turns it on for a cluster ray.init starts, making ~/.ray/auth_token,
        # unless $RAY_AUTH_MODE says otherwise; a joined cluster needs its token): without it anyone who reaches
        # the node's Ray ports runs code on the cluster. Not set here: Ray reads the mode once, at import.
        if config.ray_address:
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
            stops.append(ray.shutdown)
        else:
            from k3serve.cluster.local_ray import DASHBOARD_PORT, start_local_ray

            num_cpus = max(4, (config.prefill_max_replicas or config.prefill_replicas) * config.prefill_tp
                           + (config.decode_max_replicas or config.decode_replicas) * config.decode_tp + 1)
            dashboard = f"dashboard on http://127.0.0.1:{DASHBOARD_PORT}" if config.ray_dashboard else "no dashboard"
            with stage(f"starting a local Ray ({num_cpus} CPUs, {dashboard})"):
                stops.append(start_local_ray(num_cpus, dashboard=config.ray_dashboard).stop)
    prefill_kw, decode_kw = _worker_kwargs(config)
    secret = {"control_auth": prefill_kw["control_auth"]}
    prefill_pool = _RayPool(PrefillActor, PrefillRankActor, asdict(prefill_args), secret)
    decode_pool = _RayPool(DecodeActor, DecodeRankActor, asdict(decode_args),
                           {"prefill_tp": config.prefill_tp, **secret})
    # A cluster started here is this node alone: every worker binds and advertises loopback (advertise_host
    # still wins); a joined cluster's workers each choose their node's address (cluster/node_address.py).
    advertise_host = config.advertise_host or (LOOPBACK if single_node and not os.environ.get(HOST_IP_ENV) else None)
    replicas = {
        **{f"prefill-{i}": (prefill_pool, prefill_kw) for i in range(config.prefill_replicas)},
        **{f"decode-{i}": (decode_pool, decode_kw) for i in range(config.decode_replicas)},
    }
    actors: list[Any] = []  # every actor started, killed if the deployment fails to start
    handles = {"prefill": RayPrefillReplica, "decode": RayDecodeReplica}

    def build(pool: str, name: str) -> tuple[Any, Callable[[], None]]:
        """One more replica of `pool` (the autoscaler's), up; its stop kills its actors, then its placement group."""
        own_stops: list[Callable[[], None]] = []
        own_actors: list[Any] = []
        try:
            (leader,) = _start_ray_replicas(config, {name: replicas_of[pool]}, own_stops, own_actors,
                                            advertise_host).values()
        except BaseException:
            _kill(own_actors)
            _run_stops(own_stops)
            raise
        return handles[pool](name, leader), lambda: _run_stops([*own_stops, lambda: _stop_actor(leader)])

    replicas_of = {"prefill": (prefill_pool, prefill_kw), "decode": (decode_pool, decode_kw)}
    launcher = ReplicaLauncher(build, lambda counts: _request_resources(config, counts))
    try:
        with stage(f"starting {_replica_names(config)} as Ray actors (weights, pools, warm-up)"):
            leaders = _start_ray_replicas(config, replicas, stops, actors, advertise_host)
        stops.append(launcher.stop_all)
        for name, leader in leaders.items():
            launcher.adopt(name, lambda a=leader: _stop_actor(a))
        prefill = [RayPrefillReplica(name, a) for name, a in leaders.items() if name.startswith("prefill-")]
        decode = [RayDecodeReplica(name, a) for name, a in leaders.items() if name.startswith("decode-")]
        router, metrics = _router(config, prefill, decode, decode_args.model, decode_args.served_model_name)
    except BaseException:
        _kill(actors)
        _run_stops(stops)
        raise
    return Deployment(router, metrics, config, stops, _autoscaler(config, router, metrics, launcher))


def _kill(actors: list[Any]) -> None:
    import ray

    for actor in reversed(actors):
        with contextlib.suppress(Exception):  # already dead
            ray.kill(actor, no_restart=True)


def _request_resources(config: ServeConfig, counts: dict[str, int]) -> None:
    """Ask the Ray autoscaler for every autoscaled pool's desired replicas (their ranks' bundles), so a KubeRay
    worker group adds the pods a scale-up needs before its placement waits for them."""
    from ray.autoscaler.sdk import request_resources

    tp = {"prefill": config.prefill_tp, "decode": config.decode_tp}
    request_resources(bundles=[_bundle(config)] * sum(tp[pool] * n for pool, n in counts.items()))


def _replica_names(config: ServeConfig) -> str:
    """`prefill-0, decode-0` (with each engine's TP size past 1)."""
    pools = (("prefill", config.prefill_replicas, config.prefill_tp), ("decode", config.decode_replicas, config.decode_tp))
    return ", ".join(f"{pool}-{i}" + (f" (TP {tp})" if tp > 1 else "") for pool, n, tp in pools for i in range(n))


def _stop_actor(actor: Any) -> None:
    """The worker's own shutdown (it releases its TP followers), then its actor: a Ray cluster the
    deployment joined keeps no process or CPU of it (a restartable actor outlives its worker)."""
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=30)
    finally:
        ray.kill(actor, no_restart=True)


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after a graceful stop, which would kill the process
        before the workers are shut down; here `run` handles the signals (`_GracefulStop`)."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def stop(self) -> None:
            self.should_exit = True

    return Server


@dataclass(frozen=True)
class _RayPool:
    """One pool's replicas: the actor classes of rank 0 and of ranks > 0 of a TP replica, the EngineArgs of its
    engines as keyword arguments (what crosses to the actors)."""

    leader: Any
    follower: Any
    engine_kwargs: dict[str, Any]
    follower_kwargs: dict[str, Any]

    @property
    def tp(self) -> int:
        return self.engine_kwargs["tensor_parallel_size"]


_PLACEMENT_TIMEOUT_S = 120.0  # a TP replica's placement group not ready by then: the cluster lacks room
_RANK0_TIMEOUT_S = 120.0  # a TP replica's rank 0 answering its group's address (the actor is up)


def _start_ray_replicas(
    config: ServeConfig, replicas: dict[str, tuple[_RayPool, dict]], stops: list, actors: list,
    advertise_host: str | None,
) -> dict[str, Any]:
    """Each replica's rank-0 actor by name, once every one is up; each step is started for all
    replicas, then waited for once. A replica is a single actor when TP is 1; else TP ranks in a
    placement group: rank 0 (the replica's API; a decode one the full control server) picks the
    group's address on its own node, the followers (decode ones answer handshakes) are started
    with it, then rank 0 forms the group. A TP replica is not restarted piecewise
    (`max_restarts=0`). Every rank chooses its own node's address (`advertise_host` overrides it).
    `advertise_host` (None: each rank's node address) is what every rank binds and advertises.
    A follower whose run ends while the replicas start (it failed) fails the start at once, naming it,
    rather than leaving its rank 0 to wait out the group's join timeout.
    Every actor started is appended to `actors`, every placement group's removal to `stops`."""
    leaders: dict[str, Any] = {}
    up: dict[str, Any] = {}  # name -> ref that resolves once the replica is up
    groups: dict[str, Any] = {}  # TP > 1: name -> placement group
    for name, (pool, worker_kwargs) in replicas.items():
        if pool.tp == 1:
            options: dict[str, Any] = {"num_cpus": 1}
        else:
            groups[name] = _placement_group(config, pool.tp, stops)
            options = {"max_restarts": 0, **_in_bundle(config, groups[name], 0)}
        leaders[name] = pool.leader.options(**options).remote(
            pool.engine_kwargs, {**worker_kwargs, "name": name}, advertise_host=advertise_host)
        actors.append(leaders[name])
        if pool.tp == 1:
            up[name] = leaders[name].stats.remote()
    (device,) = _bundle(config)
    _wait_all({name: pg.ready() for name, pg in groups.items()},
              f"placing its TP ranks (one {device} each: has the cluster that many free?)", _PLACEMENT_TIMEOUT_S)
    inits = _wait_all({name: leaders[name].tp_init_method.remote() for name in groups},
                      "starting rank 0 (it answers its TP group's address)", _RANK0_TIMEOUT_S)
    runs: dict[str, Any] = {}  # "<replica> rank <r>" -> its follower's run, which ends only at rank 0's "stop"
    for name, init in inits.items():
        pool = replicas[name][0]
        for rank in range(1, pool.tp):
            follower = pool.follower.options(**_in_bundle(config, groups[name], rank)).remote()
            actors.append(follower)
            runs[f"{name} rank {rank}"] = follower.run.remote(rank, pool.engine_kwargs, init, config.transfer,
                                                              advertise_host, **pool.follower_kwargs)
        up[name] = leaders[name].start.remote()
    _wait_all(up, "starting", None, runs)  # no limit: loading a large model's weights takes what it takes
    return leaders


def _wait_all(
    refs: dict[str, Any], what: str, timeout_s: float | None, must_not_end: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The value of every named Ray ref, waited for together. The first that fails, or those still
    pending after `timeout_s`, raise a RuntimeError naming their replicas; so does any ref of
    `must_not_end` that ends first (how it failed, when it did)."""
    import ray

    watched = must_not_end or {}
    name_of = {ref: name for name, ref in (refs | watched).items()}
    pending, values = list(refs.values()), {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(pending + list(watched.values()), num_returns=1, timeout=left)
        if not ready:
            names = ", ".join(sorted(name_of[ref] for ref in pending))
            raise RuntimeError(f"{names}: {what}: not done within {timeout_s:g} s")
        (ref,) = ready
        try:
            value = ray.get(ref)
        except Exception as e:
            raise RuntimeError(f"{name_of[ref]}: {what} failed: {e}") from e
        if ref not in pending:
            raise RuntimeError(f"{name_of[ref]}: {what}: it ended before its engine started")
        pending.remove(ref)
        values[name_of[ref]] = value
    return values


def _bundle(config: ServeConfig) -> dict[str, float]:
    """One TP rank's resources: one GPU, or one CPU."""
    return {"GPU": 1} if config.device.startswith("cuda") else {"CPU": 1}


def _placement_group(config: ServeConfig, tp: int, stops: list) -> Any:
    """A placement group of `tp` bundles, packed on as few nodes as fit (PACK: a TP8 group spans
    two 4-GPU trays); its removal (which kills the actors in it) is appended to `stops`."""
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([_bundle(config)] * tp, strategy="PACK")
    stops.append(lambda: remove_placement_group(pg))
    return pg


def _in_bundle(config: ServeConfig, pg: Any, i: int) -> dict[str, Any]:
    """The actor options that put a rank in bundle `i` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = _bundle(config)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            "num_cpus": resource.get("CPU", 0), "num_gpus": resource.get("GPU", 0)}


_ABORT_GRACE_S = 5.0  # aborted requests get their clients' end; then uvicorn cancels whatever is left


class _GracefulStop:
    """What SIGTERM/SIGINT do: the first drains the ingress (api/drain.py: new requests and /health get 503) until
    the requests in flight end or `timeout_s` passes, aborts those left, then stops the server; a second signal
    during the drain aborts at once. (uvicorn alone would stop listening, so a probe sees a refused connection
    rather than 503, and wait on open streams without bound, a second SIGTERM ignored.)"""

    def __init__(self, drain: Any, server: Any, timeout_s: float) -> None:
        self.drain, self.server, self.timeout_s = drain, server, timeout_s
        self._again = asyncio.Event()
        self._stopping: asyncio.Task | None = None
        self.reason = ""  # why the server stopped, for `run`'s last line: "SIGTERM, drained"

    def on_signal(self, name: str) -> None:
        if self._stopping is None:
            self.reason = name
            self.drain.begin()
            print(f"k3serve: {name}: draining: {self.drain.in_flight} request(s) in flight get up to "
                  f"{self.timeout_s:g} s, new ones 503 (a second signal aborts them)", flush=True)
            self._stopping = asyncio.get_running_loop().create_task(self._drain_then_stop())
        else:
            print(f"k3serve: {name} again: aborting the requests in flight", flush=True)
            self._again.set()

    async def _drain_then_stop(self) -> None:
        waits = {asyncio.ensure_future(self.drain.wait_idle()), asyncio.ensure_future(self._again.wait())}
        await asyncio.wait(waits, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self.drain.in_flight:
            print(f"k3serve: aborting {self.drain.in_flight} request(s) still in flight", flush=True)
            self.reason += f", {self.drain.in_flight} request(s) aborted"
            await self.drain.abort(_ABORT_GRACE_S)
        else:
            self.reason += ", drained"
        self.server.stop()


def _ingress_server(app: Any, config: ServeConfig) -> tuple[Any, _GracefulStop]:
    """The uvicorn server of `app` (built by `build_app`) and the graceful stop its signals run, as `run` serves
    them (tests drive the drain through these)."""
    import uvicorn

    from k3serve.cluster.api.connection_guard import guarded_protocol

    limits = config.ingress_limits()
    server = _uvicorn_server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                    timeout_graceful_shutdown=_ABORT_GRACE_S,
                                                    http=guarded_protocol(limits),
                                                    timeout_keep_alive=limits.keep_alive_timeout_seconds,
                                                    h11_max_incomplete_event_size=limits.max_header_bytes))
    return server, _GracefulStop(app.state.drain, server, config.drain_timeout_seconds)


def run(config: ServeConfig) -> int:
    """Serve until SIGINT/SIGTERM, drain (`_GracefulStop`), then shut every worker (and Ray, if started
    here) down. Prints a line a stage of the start and of the stop, the URL once serving, and last
    `k3serve: stopped (REASON)` (the signal and how the drain ended, or the error that stopped it)."""
    from k3serve.cluster.api import build_app

    deployment = start_deployment(config)
    reason = "the ingress stopped"
    try:
        api_key = config.api_key.get_secret_value() if config.api_key is not None else None
        app = build_app(deployment.client, deployment.metrics, reasoning_parser=config.reasoning_parser,
                        api_key=api_key, tool_call_parser=config.tool_call_parser,
                        enable_auto_tool_choice=config.enable_auto_tool_choice, limits=config.ingress_limits())
        server, stop = _ingress_server(app, config)

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.on_signal, sig.name)
            serving = asyncio.create_task(server.serve())
            if deployment.autoscaler is not None:
                deployment.autoscaler.start()
            while not server.started and not serving.done():
                await asyncio.sleep(0.05)
            for s in server.servers:
                for sock in s.sockets:
                    host, port = sock.getsockname()[:2]
                    print(f"k3serve: serving {config.mode} on http://{host}:{port} (model {deployment.client.model_name})",
                          flush=True)
            if api_key is not None:
                print("k3serve: /v1 routes require the API key (Authorization: Bearer); /health, /metrics open",
                      flush=True)
            if config.model in PRESETS:
                say(f"{config.model} has random weights: expect arbitrary text (control characters, U+FFFD), and a "
                    "reply may end at its first token (a stop token)")
            say("Ctrl-C or SIGTERM stops it (requests in flight finish first)")
            await serving
            if deployment.autoscaler is not None:
                await deployment.autoscaler.close()

        asyncio.run(main())
        reason = stop.reason or reason
    except BaseException as e:
        reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise
    finally:
        with stage("stopping the workers" + (" and the local Ray" if _starts_ray(config) else "")):
            deployment.shutdown()
        say(f"stopped ({reason})")
    return 0


def _starts_ray(config: ServeConfig) -> bool:
    return config.mode == "disaggregated" and config.launcher == "ray" and not config.ray_address
