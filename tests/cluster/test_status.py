"""`k3serve status` against a running disaggregated server (local launcher, in this process, as `run` serves it).

Spec:
- the table has a header line (URL, health, model), one line a replica of each pool and the ingress queue, each
  with its health, running / waiting, KV block and KDA slot usage and engine settings, then TTFT, TPOT and
  handoff p50 / p90 over the last minute; every line fits one terminal row of 200 characters;
- `--json` prints the same as a `ServerStatus`, for scripts;
- an unreachable server: exit code 2, one line on stderr that names the URL, nothing on stdout;
- the last-minute window forgets what is older than a minute and interpolates its quantiles.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from k3serve.cli import build_parser, main, serve_config
from k3serve.cluster.status_metrics import StatusCollector, quantile

from _api_harness import served_deployment

pytestmark = pytest.mark.timeout(120)

FLAGS = ("--launcher", "local", "--transfer", "local", "--port", "0", "--block-size", "16", "--max-model-len", "256",
         "--cache-memory-bytes", str(16 << 20), "--served-model-name", "k3-tiny")


@pytest.fixture(scope="module")
def url(tiny_checkpoint: Path) -> Iterator[str]:
    """A served deployment that has answered 3 requests."""
    config = serve_config(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint), *FLAGS]))
    with served_deployment(config) as (_, base):
        for i in range(3):
            response = httpx.post(f"{base}/v1/completions", timeout=60,
                                  json={"prompt": f"status {i}", "max_tokens": 4, "ignore_eos": True})
            assert response.status_code == 200, response.text
        time.sleep(0.6)  # the router's next stats refresh (every 0.25 s) has seen both replicas
        yield base


def test_the_table_has_a_line_a_replica_and_the_last_minutes_latency(url, capsys) -> None:
    assert main(["status", "--url", url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{url}: healthy; models: k3-tiny"
    assert lines[1].split() == ["POOL", "REPLICA", "HEALTHY", "RUNNING", "WAITING", "KV", "BLOCKS", "KDA", "SLOTS",
                                "ACCEPT", "ENGINE"]
    rows = {tuple(line.split()[:2]): line.split() for line in lines[2:5]}
    assert set(rows) == {("prefill", "prefill-0"), ("decode", "decode-0"), ("ingress", "router")}
    for name in (("prefill", "prefill-0"), ("decode", "decode-0")):
        healthy, running, waiting, kv, kda = rows[name][2:7]
        assert (healthy, running, waiting) == ("yes", "0", "0")
        assert kv.endswith("%") and kda.endswith("%")
        assert "seqs 64," in lines[2 + list(rows).index(name)] and "block 16," in lines[2 + list(rows).index(name)]
    assert rows[("ingress", "router")][2:5] == ["-", "-", "0"]
    assert lines[5] == "latency over the last 60 s, at the ingress:"
    latency = {line.split()[0]: line for line in lines[6:]}
    assert set(latency) == {"TTFT", "TPOT", "handoff"}
    assert all("(3 observed)" in line and line.count(" ms") == 2 for line in latency.values())
    assert max(len(line) for line in lines) <= 200


def test_json_is_the_same_status_for_scripts(url, capsys) -> None:
    assert main(["status", "--url", url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["url"], status["healthy"], status["models"]) == (url, True, ["k3-tiny"])
    by_name = {r["replica"]: r for r in status["replicas"]}
    assert set(by_name) == {"prefill-0", "decode-0", "router"}
    assert by_name["decode-0"]["healthy"] is True and by_name["decode-0"]["settings"]["block_size"] == "16"
    assert by_name["router"]["running"] is None and by_name["router"]["waiting"] == 0
    latency = {lat["metric"]: lat for lat in status["latency"]}
    assert set(latency) == {"ttft", "tpot", "handoff"}
    for lat in latency.values():
        assert lat["count"] == 3 and 0 < lat["p50_seconds"] <= lat["p90_seconds"] < 60


def test_an_unreachable_server_is_one_line_on_stderr(capsys) -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["status", "--url", f"http://127.0.0.1:{port}"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and f"cannot reach http://127.0.0.1:{port}" in err and "k3serve serve" in err


def test_the_window_forgets_what_is_older_than_a_minute() -> None:
    now = [1000.0]
    window = StatusCollector("m", clock=lambda: now[0])
    window.observe("ttft", 5.0)
    now[0] += 30
    for value in (0.1, 0.2, 0.3):
        window.observe("ttft", value)
    assert window.window("ttft") == [5.0, 0.1, 0.2, 0.3]
    now[0] += 31  # the first is 61 s old
    assert window.window("ttft") == [0.1, 0.2, 0.3]
    assert quantile([0.3, 0.1, 0.2], 0.5) == pytest.approx(0.2)
    assert quantile([0.1, 0.2, 0.3], 0.9) == pytest.approx(0.28)
    now[0] += 60
    samples = {s.labels["quantile"]: s.value for f in window.collect() for s in f.samples
               if s.name == "k3serve:latency_last_minute_seconds" and s.labels["metric"] == "ttft"}
    assert all(v != v for v in samples.values())  # NaN: nothing in the window
