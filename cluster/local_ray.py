"""The single-node Ray that `k3serve serve` starts when it joins no cluster, and its removal.

By default the node runs only what the pools need: the GCS, the raylet and the agents the raylet itself starts.
Ray's autoscaler monitor and log monitor (a local node never scales; the driver takes no worker logs) are not
started, and neither is Ray's dashboard nor the API server Ray starts in its place when the dashboard is off (its
job and state APIs, which nothing here calls: 117 MB of RSS). `ray_dashboard` turns on Ray's usual processes,
the dashboard on `DASHBOARD_PORT`. Either way the node's session lives in a fresh temp folder that
`LocalRay.stop` removes, so a run leaves nothing under the temp root. Starting without them takes Ray's `Node`
(pinned Ray, `setup.py`), its `start_api_server` overridden: `ray.init` has no parameter for them.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

DASHBOARD_PORT = 8265  # Ray's default; only with ray_dashboard


@dataclass
class LocalRay:
    """A started local node: the driver connected to it, its session under `temp_dir`. Thread: the caller's."""

    temp_dir: str
    node: Any  # ray._private.node.Node when started without the monitors; None when ray.init started it

    def stop(self) -> None:
        """Disconnect, stop every process of the node, remove its temp folder. Safe to call twice."""
        import ray

        ray.shutdown()
        if self.node is not None:
            self.node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            self.node = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_local_ray(num_cpus: int, dashboard: bool = False) -> LocalRay:
    """Start a one-node Ray with `num_cpus` CPUs and connect this process to it as the driver (workers' logs
    stay in the session folder). `dashboard`: Ray's dashboard on 127.0.0.1:DASHBOARD_PORT, as `ray.init` runs it."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="k3serve-ray-")
    try:
        if dashboard:
            ray.init(num_cpus=num_cpus, include_dashboard=True, dashboard_port=DASHBOARD_PORT, _temp_dir=temp_dir,
                     log_to_driver=False)
            return LocalRay(temp_dir, None)
        from ray._private.node import Node
        from ray._private.parameter import RayParams

        params = RayParams(num_cpus=num_cpus, temp_dir=temp_dir, include_dashboard=False, no_monitor=True,
                           include_log_monitor=False)
        class NodeWithoutApiServer(Node):
            def start_api_server(self, *, include_dashboard, raise_on_failure):  # noqa: ARG002 - Node's signature
                self._webui_url = None  # no dashboard URL to publish

        node = NodeWithoutApiServer(params, head=True, shutdown_at_exit=False, spawn_reaper=True,
                                    ray_init_cluster=True)
        try:
            # WARNING: Ray's INFO lines would say it connects to an "existing" cluster, the one just started
            ray.init(address=node.address, log_to_driver=False, logging_level=logging.WARNING)
        except BaseException:
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            raise
        return LocalRay(temp_dir, node)
    except BaseException:
        with contextlib.suppress(Exception):
            ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
