"""benchmarks/gpu_serving.py, the GPU serving bundle's driver, runs end to end on the CPU (`--smoke`: k3-tiny,
short prompts): each server is started, warmed up and measured, the plan's first server's discarded warm-up
window is not among the results, and the summary holds a cell per (config, concurrency)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_serving.py"


@pytest.mark.slow
def test_the_bundle_measures_every_config_once_a_concurrency(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--configs", "all_on,static_budget",
                           "--concurrency", "1", "--time-s", "2", "--drain-s", "10", "--first-warmup-s", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    windows = [json.loads(line) for line in (out / "windows.jsonl").open()]
    assert [(w["config"], w["concurrency"]) for w in windows] == [("all_on", 1), ("static_budget", 1)]
    assert all(w["completed"] > 0 and not w["errors"] for w in windows), windows
    assert json.loads((out / "summary.json").read_text())["cells"]
