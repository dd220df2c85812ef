"""A pool's autoscaling decisions (cluster/autoscaling.py `ScalingController`) and their config (ServeConfig).

Spec:
- the desired count is the pool's load over the per-replica target, rounded up, within min and max;
- a change is made only once it has been wanted without a break for the scale-up (scale-down) delay; a
  burst or a lull shorter than its delay changes nothing;
- scaling down goes to the largest count wanted during the wait;
- ServeConfig refuses a bad autoscaling set at start, naming the field; the CLI takes the fields as flags;
- an SLO signal reads the p90 of the ingress's latency histogram over a recent window and asks for the
  replicas that bring it to the SLO;
- `k3serve status` shows each autoscaled pool's desired and current replicas and its signal.
"""

from __future__ import annotations

import asyncio

import pydantic
import pytest
from prometheus_client import CollectorRegistry, Histogram

from k3serve.cli import build_parser, serve_config
from k3serve.cluster.autoscaling import PoolAutoscaling, ScalingController
from k3serve.cluster.config import ServeConfig
from k3serve.cluster.latency_window import HistogramWindow
from k3serve.cluster.metrics import TTFT_BUCKETS
from k3serve.cluster.status import print_status

RULE = PoolAutoscaling("decode", "running_sequences", target=4, min_replicas=1, max_replicas=3,
                       scale_up_delay_seconds=10, scale_down_delay_seconds=60)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("load", "wanted"), [(0, 1), (1, 1), (4, 1), (4.5, 2), (8, 2), (9, 3), (400, 3)])
def test_the_wanted_count_is_the_load_over_the_target_within_the_bounds(load: float, wanted: int) -> None:
    assert RULE.wanted(load) == wanted


def test_a_scale_up_waits_for_its_delay_without_a_break() -> None:
    clock = Clock()
    controller = ScalingController(RULE, clock)
    assert controller.decide(8, current=1).desired == 1
    clock.now = 9.9
    assert controller.decide(8, current=1).desired == 1
    clock.now = 10.0
    decision = controller.decide(8, current=1)
    assert (decision.wanted, decision.desired, decision.load) == (2, 2, 8)


def test_a_burst_shorter_than_the_scale_up_delay_adds_nothing() -> None:
    clock = Clock()
    controller = ScalingController(RULE, clock)
    controller.decide(12, current=1)
    clock.now = 5
    assert controller.decide(2, current=1).desired == 1  # the burst ended: the wait starts over
    clock.now = 12
    assert controller.decide(12, current=1).desired == 1
    clock.now = 22
    assert controller.decide(12, current=1).desired == 3


def test_a_scale_down_waits_its_delay_and_goes_to_the_peak_wanted_during_it() -> None:
    clock = Clock()
    controller = ScalingController(RULE, clock)
    assert controller.decide(0, current=3).desired == 3
    clock.now = 30
    assert controller.decide(6, current=3).desired == 3  # still below 3: the wait goes on, 2 wanted
    clock.now = 59
    assert controller.decide(0, current=3).desired == 3
    clock.now = 60
    assert controller.decide(0, current=3).desired == 2  # not 1: 6 sequences were running during the wait
    clock.now = 61
    assert controller.decide(0, current=2).desired == 2  # the next step waits its own delay
    clock.now = 121
    assert controller.decide(0, current=2).desired == 1


def test_a_count_outside_the_bounds_moves_into_them() -> None:
    clock = Clock()
    controller = ScalingController(RULE, clock)
    controller.decide(0, current=5)
    clock.now = 60
    assert controller.decide(0, current=5).desired == 1


@pytest.mark.parametrize(("fields", "message"), [
    (dict(decode_max_replicas=2), "decode_autoscale_target: required with decode_max_replicas"),
    (dict(prefill_autoscale_target=100), "prefill_autoscale_target: set prefill_max_replicas"),
    (dict(decode_scale_down_delay_seconds=5), "decode_scale_down_delay_seconds: set decode_max_replicas"),
    (dict(decode_max_replicas=2, decode_autoscale_target=1.5, decode_autoscale_signal="kv_block_usage"),
     "decode_autoscale_target=1.5: kv_block_usage is a ratio"),
    (dict(decode_replicas=3, decode_max_replicas=2, decode_autoscale_target=4), "decode_replicas=3: starts between"),
    (dict(prefill_min_replicas=2, prefill_max_replicas=4, prefill_autoscale_target=512),
     "prefill_replicas=1: starts between prefill_min_replicas=2"),
    (dict(mode="colocated", decode_max_replicas=2, decode_autoscale_target=4), "decode_max_replicas: colocated"),
    (dict(prefill_max_replicas=2, prefill_autoscale_target=512, prefill_autoscale_signal="running_sequences"),
     "prefill_autoscale_signal"),
    (dict(decode_max_replicas=2, decode_autoscale_target=0), "decode_autoscale_target"),
])
def test_a_bad_autoscaling_config_fails_at_start_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        ServeConfig(**fields)


def test_the_autoscaling_fields_are_flags_and_make_each_pools_rule() -> None:
    args = build_parser().parse_args(["serve", "--decode-max-replicas", "3", "--decode-autoscale-signal",
                                      "kda_slot_usage", "--decode-autoscale-target", "0.7",
                                      "--decode-scale-up-delay-seconds", "5"])
    config = serve_config(args)
    assert config.autoscaling("decode") == PoolAutoscaling("decode", "kda_slot_usage", 0.7, 1, 3, 5.0, 300.0)
    assert config.autoscaling("prefill") is None


@pytest.mark.anyio
async def test_status_shows_each_autoscaled_pools_desired_and_current_replicas_and_its_signal(
    server_url: str, metrics, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the autoscaler sets them at a tick (cluster/autoscaler.py): decode wants 2, runs 1 (one starting)."""
    metrics.set_autoscaling("decode", "running_sequences", 9.0, desired=2, current=1)
    assert await asyncio.to_thread(print_status, server_url) == 0
    printed = [line.strip() for line in capsys.readouterr().out.splitlines()]
    assert "autoscaling decode: wants 2, runs 1 (running_sequences 9)" in printed, printed


class _Latency:
    """A real TTFT histogram (cluster/metrics.py's buckets) read through a window on the test's clock."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.clock = Clock()
        self.histogram = Histogram("ttft_seconds", "test", ("model_name",), buckets=TTFT_BUCKETS,
                                   registry=CollectorRegistry())
        self.window = HistogramWindow(self.histogram, {"model_name": "m"}, window_s, self.clock)

    def observe(self, *seconds: float) -> None:
        for s in seconds:
            self.histogram.labels("m").observe(s)


def test_the_slo_window_reads_the_p90_of_the_recent_observations_as_histogram_quantile_does() -> None:
    latency = _Latency()
    latency.window.sample()
    assert latency.window.quantile(0.9) == 0.0  # nothing observed
    latency.clock.now = 1
    latency.observe(*[0.3] * 9, 4.0)  # 9 in (0.25, 0.5], 1 in (2.5, 5.0]
    latency.window.sample()
    assert latency.window.quantile(0.9) == pytest.approx(0.5)  # the 9th of 10: the top of (0.25, 0.5]
    assert latency.window.quantile(0.95) == pytest.approx(2.5 + 2.5 * 0.5)
    latency.clock.now = 62
    latency.observe(*[0.05] * 10)
    latency.window.sample()  # the window now starts at t=1: the slow ones are out of it
    assert latency.window.quantile(0.9) == pytest.approx(0.04 + 0.02 * 0.9)
    latency.clock.now = 130
    latency.window.sample()
    assert latency.window.quantile(0.9) == 0.0  # nothing within the last 60 s


def test_an_slo_signal_asks_for_the_replicas_that_bring_its_p90_to_the_slo() -> None:
    rule = PoolAutoscaling("prefill", "ttft_p90_seconds", target=1.0, min_replicas=1, max_replicas=4,
                           scale_up_delay_seconds=0, scale_down_delay_seconds=0)
    assert rule.wanted(2.4 * 1) == 3  # p90 2.4 s on 1 replica against a 1 s SLO
    assert rule.wanted(0.9 * 2) == 2  # under the SLO: stays
    assert rule.wanted(0.3 * 2) == 1
