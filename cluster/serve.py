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
    if config.launcher == "ray":
        return _start_ray(config, engine_kwargs)
    return _start_local(config, engine_kwargs)


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
    from k3serve.decode.worker import DecodeWorker
    from k3serve.prefill.worker import PrefillWorker

    prefill_kw, decode_kw = _worker_kwargs(config)
    args = EngineArgs(**engine_kwargs)
    prefill = [PrefillWorker(args, name=f"prefill-{i}", **prefill_kw) for i in range(config.prefill_replicas)]
    decode = [DecodeWorker(args, name=f"decode-{i}", **decode_kw) for i in range(config.decode_replicas)]
    router, metrics = _router(config, prefill, decode, engine_kwargs)
    stops = [w.shutdown for w in prefill + decode]
    return Deployment(router, metrics, config, stops)


def _start_ray(config: ServeConfig, engine_kwargs: dict) -> Deployment:
    import ray

    from k3serve.cluster.actors import DecodeActor, PrefillActor
    from k3serve.cluster.replicas import RayDecodeReplica, RayPrefillReplica

    stops: list[Callable[[], None]] = []
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if config.ray_address:
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(
                num_cpus=max(4, config.prefill_replicas + config.decode_replicas + 1),
                include_dashboard=False,
                _temp_dir=tempfile.mkdtemp(prefix="k3serve-ray-"),
                log_to_driver=False,
            )
        stops.append(ray.shutdown)
    prefill_kw, decode_kw = _worker_kwargs(config)
    prefill_actors = [
        PrefillActor.options(num_cpus=1).remote(engine_kwargs, {**prefill_kw, "name": f"prefill-{i}"})
        for i in range(config.prefill_replicas)
    ]
    decode_actors = [
        DecodeActor.options(num_cpus=1).remote(engine_kwargs, {**decode_kw, "name": f"decode-{i}"})
        for i in range(config.decode_replicas)
    ]
    ray.get([a.load.remote() for a in prefill_actors] + [a.stats.remote() for a in decode_actors])  # wait until up
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
