"""Transfer test harness: every test must close the local agents it started (checked afterwards),
and metrics are counted in a fresh registry per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from k3serve.transfer.local import _lookup, live_agents
from k3serve.transfer.metrics import BoundTransferMetrics, transfer_metrics


@pytest.fixture(autouse=True)
def _no_agent_left_open() -> Iterator[None]:
    before = set(live_agents())
    yield
    leaked = sorted(set(live_agents()) - before)
    for endpoint in leaked:  # close them so one failure does not cascade into every later test
        agent = _lookup(endpoint)
        if agent is not None:
            agent.close()
    assert not leaked, f"local agents left open: {leaked}"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def metrics(registry: CollectorRegistry) -> BoundTransferMetrics:
    return transfer_metrics(registry).bind(model="tiny", role="prefill")
