"""The ingress's own pieces import no torch (a torch import is ~190 MiB of RSS in a process that runs no model):
the engine arguments, the shipped-model resolution, the structured output constraint check and the seed
arithmetic of stream migration. What still brings torch into the disaggregated ingress is the worker modules it
imports for their Ray actor classes and plain types (docs/BENCHMARKS.md, the embedded default's footprint)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = ("k3serve.engine.config", "k3serve.model.packaged", "k3serve.engine.constraint", "k3serve.engine.seeds",
              "k3serve.cluster.migration", "k3serve.cluster.serve")


def test_the_ingress_pieces_import_no_torch() -> None:
    code = f"import sys\nimport {', '.join(TORCH_FREE)}\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
