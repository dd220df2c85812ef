"""The micro training run the tools tests share (a few seconds on the CPU)."""

from pathlib import Path

from tools.train.recipe import RECIPES
from tools.train.train import train

MICRO_RUN = RECIPES["micro"].replace(steps=12, eval_every=6, qat_steps=3, max_files=12, eval_tokens=256)


def run_micro(out: Path) -> dict:
    """MICRO_RUN into `out`, quietly; results.json's content."""
    return train(MICRO_RUN, out, "cpu", log=lambda line: None)
