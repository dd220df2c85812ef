"""The CUDA path's Triton norm kernel, run by the Triton interpreter on CPU tensors, matches the torch
reference (the GPU test, test_norm_gpu.py, checks the same cases on the device)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _kernel_matches_reference() -> None:
    """Run where TRITON_INTERPRET=1 was set before triton was imported."""
    import torch

    from k3serve.kernels.norm import triton_norm

    from _norm_cases import check_norms_match_reference

    torch.manual_seed(0)
    check_norms_match_reference((triton_norm.rms_norm, triton_norm.gated_rms_norm, triton_norm.l2_normalize), "cpu", 3)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter runs the kernel)")
def test_triton_norms_match_reference_under_interpreter() -> None:
    """In a process of its own: triton picks the interpreter when it is imported."""
    here = str(Path(__file__).parent)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, [here, *sys.path]))}
    code = "import test_norm_triton_interpret as t; t._kernel_matches_reference()"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
