"""The training recipe (`tools/train`) and the evaluations (`benchmarks/eval_model.py`) import from the
repository root, which an installed k3serve does not put on the path."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
