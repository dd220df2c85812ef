"""Starting a Ray deployment that fails part-way (cluster/serve.py `_start_ray`).

Spec, on a Ray cluster the deployment joins (it does not own Ray):
- a TP replica whose placement group cannot be placed fails the start with an error naming the
  replica, and every actor and placement group already created is gone: the cluster has all its
  CPUs free again;
- a replica whose actor fails while starting (its control server cannot bind the address given)
  fails the start with an error naming it and why, and the replica that did start is killed;
- a TP replica whose follower fails as it starts fails the start at once (not at its rank 0's join
  timeout of 10 minutes) with an error naming the replica, the rank and why, and everything is freed;
- a deployment that started shuts down leaving its actors dead and every CPU free (the cluster
  outlives it).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
ray = pytest.importorskip("ray")  # a test extra; the GPU machine has none
from ray.util import placement_group_table

from k3serve.cluster import actors, serve
from k3serve.cluster.config import ServeConfig
from k3serve.engine import tp_group
from k3serve.transfer.backends import available_backends
from k3serve.cluster.local_ray import start_local_ray

import _failing_follower

pytestmark = pytest.mark.timeout(60)

ENGINE = dict(block_size=16, max_model_len=256, cache_memory_bytes=16 << 20)
CPUS = 3  # a TP 1 replica and a TP 2 one


@pytest.fixture(scope="module")
def ray_cluster():
    local = start_local_ray(CPUS)  # as `serve` starts it; its session folder removed at the end
    try:
        yield
    finally:
        local.stop()


def _all_freed(deadline_s: float = 10.0) -> None:
    """Until every CPU is free and no placement group is left (removal is asynchronous)."""
    end = time.monotonic() + deadline_s
    while True:
        cpus = ray.available_resources().get("CPU", 0)
        groups = [g["state"] for g in placement_group_table().values() if g["state"] != "REMOVED"]
        if cpus == CPUS and not groups:
            return
        if time.monotonic() > end:
            raise AssertionError(f"left allocated: {CPUS - cpus} CPUs, placement groups {groups}")
        time.sleep(0.1)


def test_an_unplaceable_tp_replica_fails_the_start_and_frees_everything(
    ray_cluster, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serve, "_PLACEMENT_TIMEOUT_S", 1.0)
    config = ServeConfig(model=str(tiny_checkpoint), launcher="ray", transfer="mooncake", prefill_replicas=1,
                         decode_tp=4, **ENGINE)  # 4 CPU bundles on a cluster of 3: never placed
    with pytest.raises(RuntimeError, match=r"^decode-0: placing its TP ranks \(one CPU each.*not done within 1 s"):
        serve.start_deployment(config)
    assert ray.is_initialized()  # not this deployment's to stop
    _all_freed()


def test_a_replica_that_fails_to_start_fails_the_start_and_the_others_are_killed(
    ray_cluster, tiny_checkpoint: Path
) -> None:
    if not available_backends()["nixl"]:
        pytest.skip("the NIXL backend does not import on this host")
    config = ServeConfig(model=str(tiny_checkpoint), launcher="ray", transfer="nixl",
                         advertise_host="192.0.2.254", **ENGINE)  # no interface here has it: decode cannot bind
    with pytest.raises(RuntimeError, match=r"(?s)^decode-0: starting failed: .*cannot bind 192\.0\.2\.254"):
        serve.start_deployment(config)
    _all_freed()


def test_a_tp_follower_that_fails_to_start_fails_the_start_at_once(
    ray_cluster, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray.cloudpickle.register_pickle_by_value(_failing_follower)  # Ray's workers do not import tests/
    monkeypatch.setattr(actors, "DecodeRankActor", ray.remote(max_restarts=0)(_failing_follower.RankActorFailingToStart))
    config = ServeConfig(model=str(tiny_checkpoint), launcher="ray", transfer="mooncake", decode_tp=2, **ENGINE)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)^decode-0 rank 1: starting failed: .*rank 1 found no device to run on"):
        serve.start_deployment(config)
    assert time.monotonic() - began < 45 < tp_group._JOIN_TIMEOUT.total_seconds()
    _all_freed()


def test_a_deployment_that_shuts_down_leaves_no_actor_behind(ray_cluster, tiny_checkpoint: Path) -> None:
    if not available_backends()["nixl"]:
        pytest.skip("the NIXL backend does not import on this host")
    deployment = serve.start_deployment(ServeConfig(model=str(tiny_checkpoint), launcher="ray", transfer="nixl",
                                                    **ENGINE))
    deployment.shutdown()
    assert ray.is_initialized()  # not this deployment's to stop
    _all_freed()
