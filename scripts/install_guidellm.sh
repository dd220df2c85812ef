#!/usr/bin/env bash
# Install guidellm 0.8.1 into its own venv, .venv-guidellm (gitignored), for tests/serving/test_guidellm.py
# and load runs against `k3serve serve`. Kept apart from the main venv: guidellm pins click~=8.4 and
# multidict versions the serving stack does not need, and pulls transformers + datasets.
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
