"""The training recipe (`tools/train`) and the evaluations (`benchmarks/eval_model.py`) import from the
repository root, which an installed k3serve does not put on the path. `micro_run`: one micro training run
(`_micro_run.py`), shared by the tests of the run and of the evaluations; `micro_draft_run`: the micro EAGLE
drafter trained against it."""

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


@pytest.fixture(scope="session")
def micro_draft_run(micro_run, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """(run folder, results.json) of the micro drafter run against `micro_run`'s checkpoint."""
    from tools.train.draft import train_drafter
    from tools.train.recipe import DRAFT_RECIPES

    out = tmp_path_factory.mktemp("micro-draft-run")
    return out, train_drafter(DRAFT_RECIPES["micro"], micro_run[0] / "checkpoint", out, "cpu", log=lambda line: None)
