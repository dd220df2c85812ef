"""Our Triton kernels on CPU tensors: Triton's interpreter (TRITON_INTERPRET=1) runs a kernel with numpy,
so the CPU suite checks the CUDA path's kernels against their torch references.

Triton picks the interpreter when it is first imported, so a check runs in a Python process of its own
(`run_in_interpreter`), never in the pytest process, where another test may have imported triton already.

What the interpreter of triton 3.6.0 cannot do, and how the checks live with it:
- bf16 arithmetic: numpy has no bf16, the interpreter keeps bf16 as uint16 bits and only converts them in
  casts (triton's debugging guide: "does not support operations on bfloat16"); a bf16 `tl.dot` multiplies
  the raw bits (triton-lang/triton#11584). Kernels whose dot operands are bf16 run on fp16 or fp32 inputs;
  bf16 loads, stores and casts to fp32 are exact.
- loops bounded by values read from memory (`range(start, end)` over scalar tensors) under numpy >= 2.4:
  the interpreter's `__index__` calls int() on a shape-(1,) array, which numpy 2.4 refuses;
  `_fix_scalar_index` applies the upstream fix (triton-lang/triton#9172, not in 3.6.0).
- autotuning: benchmarking a config needs a GPU driver, so an autotuned kernel is given one config.
- casts from fp32 to bf16 truncate, and to fp8 they round ties up and skip the mantissa carry (the GPU rounds to
  nearest even): a kernel whose result depends on them is checked on fp16/fp32 stores and integer rounding.
- no `tl.dot_scaled` (the Blackwell experts, kernels/moe/triton_scaled.py, run a plain-Triton product there)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (its interpreter runs the kernel on CPU)")


def run_in_interpreter(test_file: str, function: str, *args: object) -> None:
    """Call `function(*args)` of the test module at `test_file` in a fresh Python with TRITON_INTERPRET=1;
    fail with its stderr if it raises. args must be literals (they travel as their repr)."""
    here = Path(test_file).resolve()
    path = [str(here.parent), str(Path(__file__).parent), *sys.path]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(filter(None, path))}
    code = f"import _triton_interpret as t; t._call({here.stem!r}, {function!r}, {args!r})"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{here.stem}.{function}{args} under the Triton interpreter:\n{run.stderr[-4000:]}"


def _call(module: str, function: str, args: tuple) -> None:
    """The child's side of `run_in_interpreter`."""
    import torch

    _fix_scalar_index()
    torch.manual_seed(0)
    getattr(importlib.import_module(module), function)(*args)


def _fix_scalar_index() -> None:
    """Scalars are shape-(1,) arrays in the interpreter: index with the element (triton-lang/triton#9172)."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched
