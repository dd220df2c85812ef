"""The training recipe (`tools/train`) and the evaluations (`benchmarks/eval_model.py`) import from the
repository root, which an installed k3serve does not put on the path. `micro_run`: one micro training run
(`_micro_run.py`), shared by the tests of the run and of the evaluations."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="session")
def micro_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(run folder, results.json) of the micro run."""
    from _micro_run import run_micro

    out = tmp_path_factory.mktemp("micro-run")
    return out, run_micro(out)
