"""End-to-end serving fixtures: real `k3serve serve` processes (see _server_harness.py).

    disagg_server      session: Ray-launched disaggregated server, Mooncake, 1 prefill + 1 decode
    colocated_server   session: one engine, no Ray (the correctness oracle)
    server             module: the ServerSpec in `request.param` (indirect parametrization), e.g.
                           @pytest.mark.parametrize("server", [ServerSpec(transfer="nixl")],
                                                    indirect=True, ids=lambda s: s.id)
                       default (no param): the same spec as disagg_server, started anew
    artifacts_dir      $K3SERVE_ARTIFACTS_DIR, else a session temp dir

Every test here is marked `slow` (each server start costs 20-40 s on 2 cores): `-m "not gpu and not slow"` is the
quick run, and CI runs these in its second stage. Every server serves the session's tiny checkpoint as model
`k3-tiny`. Stopping one is part of
the test: SIGTERM must end it and every process it started, or the teardown errors. Server logs
are kept under artifacts_dir/server-logs/.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from _server_harness import Server, ServerSpec, serve as _serve

DISAGG = ServerSpec()
COLOCATED = ServerSpec(mode="colocated", launcher="local")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def artifacts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("K3SERVE_ARTIFACTS_DIR")
    path = Path(configured) if configured else tmp_path_factory.mktemp("artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def disagg_server(tiny_checkpoint: Path, artifacts_dir: Path) -> Iterator[Server]:
    yield from _serve(DISAGG, tiny_checkpoint, artifacts_dir, "session")


@pytest.fixture(scope="session")
def colocated_server(tiny_checkpoint: Path, artifacts_dir: Path) -> Iterator[Server]:
    yield from _serve(COLOCATED, tiny_checkpoint, artifacts_dir, "session")


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tiny_checkpoint: Path, artifacts_dir: Path) -> Iterator[Server]:
    spec: ServerSpec = getattr(request, "param", DISAGG)
    yield from _serve(spec, tiny_checkpoint, artifacts_dir, request.module.__name__)
