"""README command 1's server, `k3serve serve` with no options (1 prefill + 1 decode replica of the shipped trained
k3-code on a local Ray, Mooncake over loopback), as a new user starts it: a fresh HOME.

Spec:
- at idle its whole process tree holds at most 1.5 GiB (PSS: each shared page counted once over the tree);
- its output says what it is doing: a line a start stage with its time, the URL and the model, and last a `stopped`
  line with the reason;
- once it has exited, nothing it made is left in the temp root (Ray's session folder, torch's caches) beside
  HOME, which the harness keeps under the temp root too.
"""

from __future__ import annotations

import re
import time

import pytest

from _server_harness import ServerSpec, launch, tree_memory

pytestmark = pytest.mark.timeout(240)

MAX_TREE_PSS_BYTES = int(1.5 * 2**30)


def test_the_embedded_default_is_light_says_what_it_does_and_cleans_up() -> None:
    with launch(ServerSpec(embedded_default=True), None) as server:
        time.sleep(2.0)  # idle: the warm-up's transients are freed
        processes = tree_memory(server.process.pid)
        commands = " ".join(p.command for p in processes)
        assert "ray::PrefillActor" in commands and "ray::DecodeActor" in commands
        pss = sum(p.pss_bytes for p in processes)
        table = "\n".join(f"{p.rss_bytes >> 20:6d} {p.pss_bytes >> 20:6d} MiB  {p.command[:80]}" for p in processes)
        assert pss <= MAX_TREE_PSS_BYTES, f"the tree holds {pss >> 20} MiB (RSS, PSS):\n{table}"
        assert "autoscaler/_private/monitor.py" not in commands and "log_monitor.py" not in commands  # Ray's, unused
        server.stop()
        left = sorted(path.name for path in server.workdir.iterdir())
        log = server.log_text()
    assert left == ["home", "server.log"], f"left in the temp root: {left}"
    lines = [line for line in log.splitlines() if line.startswith("k3serve: ")]
    stages = [m.group(1) for line in lines if (m := re.fullmatch(r"k3serve: (.*): done in \d+\.\d s", line))]
    assert stages == [
        "starting a local Ray (4 CPUs, no dashboard)",
        "starting prefill-0, decode-0 as Ray actors (weights, pools, warm-up)",
        "stopping the workers and the local Ray"]
    assert any(re.fullmatch(r"k3serve: serving disaggregated on http://\S+ \(model k3-code\)", line) for line in lines)
    assert not any("random weights" in line for line in lines)
    assert lines[-1] == "k3serve: stopped (SIGTERM, drained)"
