"""The local Ray that `k3serve serve` starts when it joins no cluster (cluster/local_ray.py).

Spec:
- it runs the GCS, the raylet and the raylet's agents, not Ray's autoscaler monitor or log monitor;
- `stop` leaves no Ray process and removes its session folder; a second `stop` does nothing;
- `ray_dashboard` is refused where no local Ray is started (the local launcher, a joined cluster, colocated).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
ray = pytest.importorskip("ray")  # a test extra; the GPU machine has none

from k3serve.cluster.config import ServeConfig
from k3serve.cluster.local_ray import start_local_ray

pytestmark = pytest.mark.timeout(60)


def _commands_mentioning(text: str) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            out.append(command)
    return out


def test_it_runs_without_the_monitors_and_leaves_nothing_when_stopped() -> None:
    local = start_local_ray(1)
    try:
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 1
        commands = _commands_mentioning(local.temp_dir)
        assert any("gcs_server" in c for c in commands) and any("raylet" in c for c in commands)
        assert not any("monitor.py" in c for c in commands), commands  # autoscaler/_private/monitor.py, log_monitor.py
    finally:
        local.stop()
    assert not ray.is_initialized()
    assert not Path(local.temp_dir).exists()
    deadline = time.monotonic() + 10  # the raylet's agents exit after it
    while _commands_mentioning(local.temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _commands_mentioning(local.temp_dir) == []
    local.stop()


@pytest.mark.parametrize("given", [{"launcher": "local", "transfer": "local"}, {"ray_address": "10.0.0.1:6379"},
                                   {"mode": "colocated"}], ids=["local-launcher", "joined-cluster", "colocated"])
def test_the_dashboard_is_refused_where_no_local_ray_starts(given: dict) -> None:
    with pytest.raises(ValueError, match="ray_dashboard is the dashboard of the local Ray"):
        ServeConfig(ray_dashboard=True, **given)
