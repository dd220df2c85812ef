"""Fixtures the model tests share, beside the repository-wide ones (tests/conftest.py):

    odd_vocab_checkpoint   k3-tiny with a vocab of 509, which no TP size > 1 divides (padded vocab shards)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from k3serve.model.checkpoint import make_checkpoint
from tiny_presets import k3_tiny_odd_vocab


@pytest.fixture(scope="session")
def odd_vocab_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(k3_tiny_odd_vocab(), tmp_path_factory.mktemp("k3-tiny-vocab-509"), seed=0)
