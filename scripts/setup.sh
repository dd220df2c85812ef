#!/usr/bin/env bash
# Create .venv with the CPU build of torch and k3serve (editable) with its serving and test extras.
# Safe to re-run. CPU torch goes first: a looser torch spec would pull a multi-GB CUDA build.
# System packages (Debian, root): libibverbs1 for Mooncake; install them with --system-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--system-deps" ] && command -v apt-get >/dev/null; then
  apt-get install -y -q libibverbs1 >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${K3SERVE_TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[serve,test]"
.venv/bin/python -m pip install -q --no-deps "nixl-cu13==1.5.1"
echo "k3serve installed in $(pwd)/.venv"
