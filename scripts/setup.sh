#!/usr/bin/env bash
# Create .venv with the CPU build of torch and k3serve (editable) with its serving and test extras.
# Safe to re-run. CPU torch goes first: a looser torch spec would pull a multi-GB CUDA build.
#   --system-deps  Debian packages (root): libibverbs1, which Mooncake links even without RDMA
#   --test-tools   what the deploy tests run: promtool, helm, kubectl, kubernetes-validate, ...
# Triton comes with the package (xgrammar, for structured outputs, needs it), pinned to the GPU machine's
# version in the same install: its interpreter runs our GPU kernels on the CPU in the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
SYSTEM_DEPS=0; TEST_TOOLS=0
for arg in "$@"; do
  case "$arg" in
    --system-deps) SYSTEM_DEPS=1 ;;
    --test-tools) TEST_TOOLS=1 ;;
    *) echo "usage: $0 [--system-deps] [--test-tools]" >&2; exit 2 ;;
  esac
done
START=$SECONDS
step() { echo "k3serve setup: $* ($((SECONDS - START)) s so far)"; }  # a line a stage: pip -q prints nothing
if [ "$SYSTEM_DEPS" = 1 ] && command -v apt-get >/dev/null; then
  step "apt: libibverbs1"
  apt-get install -y -q libibverbs1 >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null)
fi
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
step "pip, setuptools"
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77"
step "torch (CPU build, ~200 MB)"
.venv/bin/python -m pip install -q "torch==${K3SERVE_TORCH_VERSION:-2.13.0}"
step "k3serve and its serving and test packages (Ray, Mooncake, xgrammar, ...)"
# setuptools' "Editable installation ... be careful with folders of the package's name" notice (pip shows the
# backend's warnings) says nothing actionable here: the checkout is the package.
PYTHONWARNINGS="ignore:Editable installation" \
  .venv/bin/python -m pip install -q -e ".[serve,test]" "triton==3.6.0"  # the GPU machine's version
step "NIXL"
.venv/bin/python -m pip install -q --no-deps "nixl-cu13==1.5.1"
if [ "$TEST_TOOLS" = 1 ]; then
  step "deploy test tools (promtool, helm, kubectl, ...)"
  bash scripts/install_deploy_tools.sh .venv
fi
echo "k3serve installed in $(pwd)/.venv in $((SECONDS - START)) s ($(du -sh .venv | cut -f1) on disk)"
