"""Every test starts from the same RNG state, so a failure reproduces when run alone."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
