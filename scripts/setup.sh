#!/usr/bin/env bash
# Create .venv with the CPU build of torch and k3serve installed (editable) with its test extras.
# Safe to re-run. CPU torch goes first: a looser torch spec would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${K3SERVE_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
echo "k3serve installed in $(pwd)/.venv"
