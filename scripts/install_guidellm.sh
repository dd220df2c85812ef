#!/usr/bin/env bash
# Optional: guidellm 0.8.1 in its own venv, .venv-guidellm (gitignored), for load runs against `k3serve
# serve` from an environment that should not carry it. The test extras install guidellm into the main venv
# (it downgrades click and multidict; `pip check` stays clean); tests/serving/test_guidellm.py uses that one
# and falls back to this venv. guidellm also pulls transformers + datasets.
# CPU torch goes first (guidellm declares an unpinned torch; a looser spec pulls a multi-GB CUDA build).
# Safe to re-run; prints the venv's guidellm path. PYTHON picks the interpreter (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${K3SERVE_GUIDELLM_VENV:-.venv-guidellm}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/guidellm" ]; then
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==${K3SERVE_TORCH_VERSION:-2.13.0}"
  "$VENV/bin/python" -m pip install -q "guidellm==0.8.1"
  "$VENV/bin/python" -m pip check
fi
echo "$(pwd)/$VENV/bin/guidellm"
