"""A disaggregated deployment whose pools were given different engine arguments on `k3serve serve`'s command line
runs each pool's engines with its own, and `k3serve status` reports them per pool.

Started as `k3serve serve` starts one (flags -> ServeConfig -> `start_deployment`, the ingress `run` serves), with
the local launcher and transfer: the decode pool runs at most 2 requests with prefix caching off (so its KDA slots
are its 2 running requests' alone), the prefill pool 4 with prefix caching on, out of exactly 32 MLA blocks.

Spec:
- `k3serve status` reports each replica's engine settings (`k3serve:engine_config_info`), per pool; a replica's
  settings are one series, replaced when they change;
- the decode engine never runs more than 2 requests: 5 at once all complete, 2 decoding at a time, the others
  waiting in the ingress's admission queue; every decode slot a running request's;
- the prefill engine keeps caching prefixes: a prompt sent twice hits its cache the second time.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
from prometheus_client import CollectorRegistry

from k3serve.cli import build_parser, main, serve_config
from k3serve.cluster.metrics import ENGINE_SETTINGS, IngressMetrics
from k3serve.cluster.serve import Deployment

from _api_harness import served_deployment

pytestmark = pytest.mark.timeout(120)

FLAGS = ("--launcher", "local", "--transfer", "local", "--port", "0", "--block-size", "16", "--max-model-len", "256",
         "--cache-memory-bytes", str(16 << 20), "--max-num-seqs", "4", "--prefill-num-gpu-blocks-override", "32",
         "--decode-max-num-seqs", "2", "--no-decode-enable-prefix-caching")
LONG = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def served(tiny_checkpoint: Path) -> Iterator[tuple[Deployment, str]]:
    """The deployment and its ingress's URL, served in a thread as `run` serves it."""
    with served_deployment(serve_config(build_parser().parse_args(["serve", "--model", str(tiny_checkpoint),
                                                                    *FLAGS]))) as served:
        yield served


def _engine_settings(printed: str) -> dict[str, dict[str, str]]:
    """The labels of each `k3serve:engine_config_info` line of a /metrics text, by pool."""
    lines = [line for line in printed.splitlines() if "k3serve:engine_config_info{" in line]
    labels = [dict(re.findall(r'(\w+)="([^"]*)"', line)) for line in lines]
    return {label["pool"]: label for label in labels}


def test_status_reports_each_pools_engine_settings(served, capsys: pytest.CaptureFixture[str]) -> None:
    _, url = served
    assert main(["status", "--url", url, "--json"]) == 0
    settings = {r["pool"]: r["settings"] for r in json.loads(capsys.readouterr().out)["replicas"] if r["settings"]}
    assert set(settings) == {"prefill", "decode"}
    prefill, decode = settings["prefill"], settings["decode"]
    assert (prefill["max_num_seqs"], prefill["enable_prefix_caching"], prefill["num_kda_slots"]) == ("4", "true", "8")
    assert prefill["num_gpu_blocks"] == "32"  # --prefill-num-gpu-blocks-override
    assert (decode["max_num_seqs"], decode["enable_prefix_caching"], decode["num_kda_slots"]) == ("2", "false", "2")
    assert int(decode["num_gpu_blocks"]) > 32  # all that its 16 MiB hold
    assert prefill["block_size"] == decode["block_size"] == "16"
    assert prefill["cuda_graphs"] == decode["cuda_graphs"] == "false"  # CPU
    assert (prefill["max_num_batched_tokens"], prefill["kda_checkpoint_mode"]) == ("8192", "in_pass")  # defaults
    for labels in settings.values():  # every setting the engine reports, none missing
        assert set(labels) == set(ENGINE_SETTINGS) and all(labels.values()), labels


def test_a_replicas_settings_are_one_series_replaced_when_they_change() -> None:
    """A restarted replica's engine may have other pools: its old settings must not linger beside the new."""
    metrics = IngressMetrics(CollectorRegistry(), model_name="m")
    settings = dict.fromkeys(ENGINE_SETTINGS, "1")
    metrics.set_engine_settings("decode", "decode-0", settings)
    metrics.set_engine_settings("decode", "decode-0", {**settings, "num_gpu_blocks": "2"})
    metrics.set_engine_settings("prefill", "prefill-0", settings)
    printed = metrics.render().decode()
    assert {pool: labels["num_gpu_blocks"] for pool, labels in _engine_settings(printed).items()} == {
        "decode": "2", "prefill": "1"}
    assert printed.count("k3serve:engine_config_info{") == 2
    metrics.remove_replica("decode", "decode-0")
    assert set(_engine_settings(metrics.render().decode())) == {"prefill"}


def test_the_decode_engine_runs_at_most_its_max_num_seqs(served) -> None:
    deployment, url = served
    router = deployment.client
    (decode,) = router.decode
    running, queued, slot_usage = set(), set(), set()

    def complete(i: int) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", json={"prompt": f"request {i} says", **LONG}, timeout=60)

    with ThreadPoolExecutor(5) as pool:
        answers = [pool.submit(complete, i) for i in range(5)]
        while not all(a.done() for a in answers):
            stats = asyncio.run(decode.stats())
            running.add(stats.num_running)
            slot_usage.add(stats.slot_usage)
            queued.add(router.admission.num_waiting)
            time.sleep(0.005)
    for answer in answers:
        response = answer.result()
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert max(running) == 2  # reached, never passed
    assert max(queued) >= 1  # the others waited for decode room at the ingress
    assert max(slot_usage) == 1.0  # 2 slots: no checkpoint slots beside the running requests'


def test_the_prefill_engine_still_caches_prefixes(served) -> None:
    deployment, url = served
    (prefill,) = deployment.client.prefill
    prompt = "A prompt long enough to fill two blocks of sixteen tokens, sent twice to the same prefill engine."
    hits = lambda: asyncio.run(prefill.handoff._engine.call(  # noqa: E731
        lambda e: e.scheduler.prefix_cache.num_hits))
    before = hits()
    for _ in range(2):
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
        assert response.status_code == 200, response.text
    assert hits() == before + 1
