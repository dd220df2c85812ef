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
    """Workers in this process; the ranks > 0 of a TP engine (prefill or decode) in child processes."""
    import multiprocessing

    from k3serve.decode import rank as decode_rank
    from k3serve.decode.worker import DecodeWorker
    from k3serve.engine.tp_group import TPGroup
    from k3serve.prefill import rank as prefill_rank
    from k3serve.prefill.worker import PrefillWorker

    prefill_kw, decode_kw = _worker_kwargs(config)
    prefill_args = EngineArgs(**engine_kwargs, tensor_parallel_size=config.prefill_tp)
    decode_args = EngineArgs(**engine_kwargs, tensor_parallel_size=config.decode_tp)
    stops: list[Callable[[], None]] = []
    ctx = multiprocessing.get_context("spawn")

    def tp_group(tp: int, target: Callable, follower_args: Callable[[int, str], tuple]) -> TPGroup | None:
        """Rank 0's group of a TP engine; ranks > 0 start first, in child processes."""
        if tp == 1:
            return None
        init = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(1, tp):
            proc = ctx.Process(target=target, args=follower_args(rank, init), daemon=True)
            proc.start()
            stops.append(lambda p=proc: _join_or_kill(p))
        return TPGroup(0, tp, init)

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
                         lambda rank, init: (rank, decode_args, init, config.transfer, "127.0.0.1", config.prefill_tp))
        worker = DecodeWorker(decode_args, name=f"decode-{i}", group=group, **decode_kw)
        stops.append(worker.shutdown)
        decode.append(worker)
    router, metrics = _router(config, prefill, decode, engine_kwargs)
    return Deployment(router, metrics, config, stops)


def _join_or_kill(process, timeout_s: float = 30.0) -> None:
    process.join(timeout_s)
    if process.is_alive():
        process.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ray(config: ServeConfig, engine_kwargs: dict) -> Deployment:
    import ray

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
    prefill_actors = [
        _start_ray_prefill(config, engine_kwargs, {**prefill_kw, "name": f"prefill-{i}"}, stops)
        for i in range(config.prefill_replicas)
    ]
    decode_actors = [
        _start_ray_decode(config, engine_kwargs, {**decode_kw, "name": f"decode-{i}"}, stops)
        for i in range(config.decode_replicas)
    ]
    ray.get([a.stats.remote() for a in prefill_actors + decode_actors])  # wait until up
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


def _start_ray_prefill(config: ServeConfig, engine_kwargs: dict, worker_kwargs: dict, stops: list) -> Any:
    """One prefill replica: a single actor, or TP ranks packed in a placement group (rank 0 is the
    replica's API; ranks > 0 follow it). A TP replica is not restarted piecewise."""
    from k3serve.cluster.actors import PrefillActor, PrefillRankActor

    tp = config.prefill_tp
    kwargs = {**engine_kwargs, "tensor_parallel_size": tp}
    if tp == 1:
        return PrefillActor.options(num_cpus=1).remote(kwargs, worker_kwargs)
    init, in_bundle = _tp_placement(config, tp, stops)
    for rank in range(1, tp):
        follower = PrefillRankActor.options(**in_bundle(rank)).remote()
        follower.run.remote(rank, kwargs, init, config.transfer)  # returns when rank 0 says "stop"
    return PrefillActor.options(max_restarts=0, **in_bundle(0)).remote(kwargs, worker_kwargs, init_method=init)


def _start_ray_decode(config: ServeConfig, engine_kwargs: dict, worker_kwargs: dict, stops: list) -> Any:
    """One decode replica: a single actor, or TP ranks packed in a placement group (rank 0 is the
    replica's API and full control server; ranks > 0 follow it and answer handshakes). A TP
    replica is not restarted piecewise."""
    from k3serve.cluster.actors import DecodeActor, DecodeRankActor

    tp = config.decode_tp
    kwargs = {**engine_kwargs, "tensor_parallel_size": tp}
    if tp == 1:
        return DecodeActor.options(num_cpus=1).remote(kwargs, worker_kwargs)
    init, in_bundle = _tp_placement(config, tp, stops)
    host = worker_kwargs.get("host", "127.0.0.1")
    for rank in range(1, tp):
        follower = DecodeRankActor.options(**in_bundle(rank)).remote()
        follower.run.remote(rank, kwargs, init, config.transfer, host, config.prefill_tp)  # until rank 0 says "stop"
    return DecodeActor.options(max_restarts=0, **in_bundle(0)).remote(kwargs, worker_kwargs, init_method=init)


def _tp_placement(config: ServeConfig, tp: int, stops: list) -> tuple[str, Callable[[int], dict]]:
    """A placement group of `tp` bundles (one GPU, or one CPU, each) packed on one node: the TP
    group's init address (rank 0's node) and the actor options that put rank i in bundle i."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    resource = {"GPU": 1} if config.device.startswith("cuda") else {"CPU": 1}
    pg = placement_group([resource] * tp, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=120)
    stops.append(lambda: remove_placement_group(pg))
    init = f"tcp://{_bundle_ip(pg)}:{_free_port()}"

    def in_bundle(i: int) -> dict:
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                "num_cpus": resource.get("CPU", 0), "num_gpus": resource.get("GPU", 0)}

    return init, in_bundle


def _bundle_ip(pg) -> str:
    """The node address of a placement group's first bundle (where rank 0 listens)."""
    import ray
    from ray.util.placement_group import placement_group_table

    node_id = placement_group_table(pg)["bundles_to_node_id"][0]
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


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
