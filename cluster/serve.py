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
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.metrics import IngressMetrics
from k3serve.cluster.node_address import LOOPBACK
from k3serve.engine.config import EngineArgs
from k3serve.engine.llm_engine import resolve_model_dir

log = logging.getLogger(__name__)


@dataclass
class Deployment:
    client: Any  # EngineClient
    metrics: IngressMetrics
    config: ServeConfig
    _stops: list[Callable[[], None]] = field(default_factory=list)

    def shutdown(self) -> None:
        """Stop every worker (and Ray, if this deployment started it). Safe to call twice."""
        while self._stops:
            stop = self._stops.pop()
            try:
                stop()
            except Exception as e:  # keep stopping the rest
                log.warning("shutdown step failed: %r", e)


def start_deployment(config: ServeConfig) -> Deployment:
    engine_kwargs = config.engine_kwargs()
    # Write a preset checkpoint once, here, rather than racing in every worker.
    engine_kwargs["model"] = str(resolve_model_dir(config.model, config.seed, EngineArgs().model_cache_dir))
    engine_kwargs["served_model_name"] = config.served_model_name or os.path.basename(os.path.normpath(config.model))
    if config.mode == "colocated":
        from k3serve.engine.async_engine import AsyncEngine

        engine = AsyncEngine(EngineArgs(**engine_kwargs))
        metrics = IngressMetrics(model_name=engine.model_name)
        return Deployment(engine, metrics, config, [engine.shutdown])
    _check_tp(config, engine_kwargs["model"])
    if config.launcher == "ray":
        return _start_ray(config, engine_kwargs)
    return _start_local(config, engine_kwargs)


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
    prefill = {"transfer": config.transfer, "lease_seconds": config.lease_seconds}
    decode = {
        "transfer": config.transfer, "lease_seconds": config.lease_seconds, "prefill_tp": config.prefill_tp,
        "verify_checksums": config.verify_checksums,
    }
    return prefill, decode


def _router(config: ServeConfig, prefill: list, decode: list, engine_kwargs: dict) -> tuple[Any, IngressMetrics]:
    from k3serve.cluster.router import DisaggregatedRouter
    from k3serve.model.tokenizer import Tokenizer

    name = engine_kwargs["served_model_name"]
    metrics = IngressMetrics(model_name=name)
    tokenizer = Tokenizer.from_dir(engine_kwargs["model"])
    return DisaggregatedRouter(prefill, decode, tokenizer, name, config.max_model_len, metrics), metrics


def _start_local(config: ServeConfig, engine_kwargs: dict) -> Deployment:
    """Workers in this process; the ranks > 0 of a TP engine (prefill or decode) in child processes.
    One machine: every address is 127.0.0.1 (the workers' defaults)."""
    import multiprocessing

    from k3serve.decode import rank as decode_rank
    from k3serve.decode.worker import DecodeWorker
    from k3serve.engine.tp_group import TPGroup, leader_store
    from k3serve.prefill import rank as prefill_rank
    from k3serve.prefill.worker import PrefillWorker

    prefill_kw, decode_kw = _worker_kwargs(config)
    # A prefill engine stops every request at its first token: it never runs a decode step, so it
    # captures no decode CUDA graphs (their capture time and memory pool would buy nothing).
    prefill_args = EngineArgs(**{**engine_kwargs, "enforce_eager": True}, tensor_parallel_size=config.prefill_tp)
    decode_args = EngineArgs(**engine_kwargs, tensor_parallel_size=config.decode_tp)
    stops: list[Callable[[], None]] = []
    ctx = multiprocessing.get_context("spawn")

    def tp_group(tp: int, target: Callable, follower_args: Callable[[int, str], tuple]) -> TPGroup | None:
        """Rank 0's group of a TP engine; ranks > 0 start first, in child processes."""
        if tp == 1:
            return None
        store, init = leader_store(tp, LOOPBACK)
        for rank in range(1, tp):
            proc = ctx.Process(target=target, args=follower_args(rank, init), daemon=True)
            proc.start()
            stops.append(lambda p=proc: _join_or_kill(p))
        return TPGroup(0, tp, init, store=store)

    prefill = []
    for i in range(config.prefill_replicas):
        group = tp_group(config.prefill_tp, prefill_rank.follower_main,
                         lambda rank, init: (rank, prefill_args, init, config.transfer))
        worker = PrefillWorker(prefill_args, name=f"prefill-{i}", group=group, **prefill_kw)
        stops.append(worker.shutdown)
        prefill.append(worker)
    decode = []
    for i in range(config.decode_replicas):
        group = tp_group(config.decode_tp, decode_rank.follower_main,
                         lambda rank, init: (rank, decode_args, init, config.transfer, LOOPBACK, config.prefill_tp))
        worker = DecodeWorker(decode_args, name=f"decode-{i}", group=group, **decode_kw)
        stops.append(worker.shutdown)
        decode.append(worker)
    router, metrics = _router(config, prefill, decode, engine_kwargs)
    return Deployment(router, metrics, config, stops)


def _join_or_kill(process, timeout_s: float = 30.0) -> None:
    process.join(timeout_s)
    if process.is_alive():
        process.kill()


def _start_ray(config: ServeConfig, engine_kwargs: dict) -> Deployment:
    import ray

    from k3serve.cluster.actors import DecodeActor, DecodeRankActor, PrefillActor, PrefillRankActor
    from k3serve.cluster.replicas import RayDecodeReplica, RayPrefillReplica

    stops: list[Callable[[], None]] = []
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if config.ray_address:
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(
                num_cpus=max(4, config.prefill_replicas * config.prefill_tp + config.decode_replicas * config.decode_tp + 1),
                include_dashboard=False,
                _temp_dir=tempfile.mkdtemp(prefix="k3serve-ray-"),
                log_to_driver=False,
            )
        stops.append(ray.shutdown)
    prefill_kw, decode_kw = _worker_kwargs(config)
    prefill_pool = _RayPool(PrefillActor, PrefillRankActor, config.prefill_tp, {})
    decode_pool = _RayPool(DecodeActor, DecodeRankActor, config.decode_tp, {"prefill_tp": config.prefill_tp})
    prefill_actors, prefill_up = zip(*[
        _start_ray_replica(config, prefill_pool, engine_kwargs, {**prefill_kw, "name": f"prefill-{i}"}, stops)
        for i in range(config.prefill_replicas)
    ])
    decode_actors, decode_up = zip(*[
        _start_ray_replica(config, decode_pool, engine_kwargs, {**decode_kw, "name": f"decode-{i}"}, stops)
        for i in range(config.decode_replicas)
    ])
    ray.get([*prefill_up, *decode_up])  # wait until up; a failed start raises its own error here
    for actor in prefill_actors + decode_actors:
        stops.append(lambda a=actor: ray.get(a.shutdown.remote(), timeout=30))
    prefill = [RayPrefillReplica(f"prefill-{i}", a) for i, a in enumerate(prefill_actors)]
    decode = [RayDecodeReplica(f"decode-{i}", a) for i, a in enumerate(decode_actors)]
    router, metrics = _router(config, prefill, decode, engine_kwargs)
    return Deployment(router, metrics, config, stops)


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after a graceful stop, which would kill the process
        before the workers are shut down; here the signals only stop the server."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def stop(self) -> None:
            self.should_exit = True

    return Server


@dataclass(frozen=True)
class _RayPool:
    """The actor classes of one pool's replicas: rank 0, and ranks > 0 of a TP replica."""

    leader: Any
    follower: Any
    tp: int
    follower_kwargs: dict[str, Any]


def _start_ray_replica(
    config: ServeConfig, pool: _RayPool, engine_kwargs: dict, worker_kwargs: dict, stops: list
) -> tuple[Any, Any]:
    """One replica: its rank-0 actor, and the ref that resolves once it is up. A single actor when
    TP is 1; else TP ranks in a placement group: rank 0 (the replica's API; a decode one the full
    control server) picks the group's address on its own node, the followers (decode ones answer
    handshakes) are started with it, then rank 0 forms the group. A TP replica is not restarted
    piecewise (`max_restarts=0`). Every rank chooses its own node's address (`advertise_host`
    overrides it)."""
    import ray

    kwargs = {**engine_kwargs, "tensor_parallel_size": pool.tp}
    if pool.tp == 1:
        actor = pool.leader.options(num_cpus=1).remote(kwargs, worker_kwargs, advertise_host=config.advertise_host)
        return actor, actor.stats.remote()
    in_bundle = _tp_placement(config, pool.tp, stops)
    leader = pool.leader.options(max_restarts=0, **in_bundle(0)).remote(
        kwargs, worker_kwargs, advertise_host=config.advertise_host)
    init = ray.get(leader.tp_init_method.remote(), timeout=120)
    for rank in range(1, pool.tp):
        follower = pool.follower.options(**in_bundle(rank)).remote()
        follower.run.remote(rank, kwargs, init, config.transfer, config.advertise_host,
                            **pool.follower_kwargs)  # returns when rank 0 says "stop"
    return leader, leader.start.remote()


def _tp_placement(config: ServeConfig, tp: int, stops: list) -> Callable[[int], dict]:
    """A placement group of `tp` bundles (one GPU, or one CPU, each), packed on as few nodes as
    fit (PACK: a TP8 group spans two 4-GPU trays): the actor options that put rank i in bundle i."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = {"GPU": 1} if config.device.startswith("cuda") else {"CPU": 1}
    pg = placement_group([resource] * tp, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    stops.append(lambda: remove_placement_group(pg))

    def in_bundle(i: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                "num_cpus": resource.get("CPU", 0), "num_gpus": resource.get("GPU", 0)}

    return in_bundle


def run(config: ServeConfig) -> int:
    """Serve until SIGINT/SIGTERM (uvicorn turns both into a graceful stop), then shut every
    worker (and Ray, if started here) down."""
    import uvicorn

    from k3serve.cluster.api import build_app

    _Server = _uvicorn_server_class()
    deployment = start_deployment(config)
    try:
        app = build_app(deployment.client, deployment.metrics)
        server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, server.stop)
            serving = asyncio.create_task(server.serve())
            while not server.started and not serving.done():
                await asyncio.sleep(0.05)
            for s in server.servers:
                for sock in s.sockets:
                    host, port = sock.getsockname()[:2]
                    print(f"k3serve: serving {config.mode} on http://{host}:{port} (model {deployment.client.model_name})",
                          flush=True)
            await serving

        asyncio.run(main())
    finally:
        deployment.shutdown()
    return 0
