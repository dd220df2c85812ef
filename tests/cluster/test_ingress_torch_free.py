"""The disaggregated ingress imports no torch (a torch import is ~190 MiB of RSS in a process that runs no model):
the engine arguments, the shipped-model resolution, the structured output constraint check, the router, the
replicas and their Ray actor classes (whose workers import torch inside the actor), the HTTP layer, and the
plain values that come back from the workers (engine stats, prefill results, deltas), which unpickling imports."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = ("k3serve.engine.config", "k3serve.model.packaged", "k3serve.engine.constraint", "k3serve.engine.seeds",
              "k3serve.engine.stream_types", "k3serve.engine.outputs", "k3serve.prefill.messages",
              "k3serve.decode.errors", "k3serve.cluster.migration", "k3serve.cluster.router", "k3serve.cluster.replicas",
              "k3serve.cluster.actors", "k3serve.cluster.api.app", "k3serve.cluster.serve")


def test_the_ingress_imports_no_torch() -> None:
    code = f"import sys\nimport {', '.join(TORCH_FREE)}\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
