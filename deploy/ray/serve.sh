#!/usr/bin/env bash
# Start `k3serve serve` on the Ray head once the cluster has the GPUs the config asks for.
#
#   ray exec deploy/ray/gb300-rack.yaml --tmux \
#       'bash ~/k3serve/deploy/ray/serve.sh ~/k3serve/deploy/configs/k3-gb300.yaml'
#
# Waits up to K3SERVE_WAIT_S seconds (default 900) for K3SERVE_WAIT_GPUS GPUs to join (default:
# prefill_replicas * prefill_tp + decode_replicas * decode_tp from the config; 0 = do not wait),
# then execs the server with --ray-address auto (join the cluster this node belongs to). Extra
# arguments go to `k3serve serve` and win over the file.
set -euo pipefail
CONFIG=${1:?usage: serve.sh CONFIG.yaml [k3serve serve flags...]}
shift
VENV=${K3SERVE_VENV:-$HOME/k3serve-venv}
ENV_FILE=${K3SERVE_ENV_FILE:-$(dirname "$0")/gb300.env}
if [ -f "$ENV_FILE" ]; then
    set -a
    # shellcheck disable=SC1090
    . "$ENV_FILE"
    set +a
fi
"$VENV/bin/python" - "$CONFIG" "${K3SERVE_WAIT_S:-900}" "${K3SERVE_WAIT_GPUS:-}" <<'PY'
import sys, time
import ray, yaml

cfg = yaml.safe_load(open(sys.argv[1]))
need = int(sys.argv[3]) if sys.argv[3] else (
    cfg.get("prefill_replicas", 1) * cfg.get("prefill_tp", 1) + cfg.get("decode_replicas", 1) * cfg.get("decode_tp", 1)
)
if need == 0:
    sys.exit(0)
deadline = time.monotonic() + float(sys.argv[2])
ray.init(address="auto", logging_level="ERROR")
while (have := ray.cluster_resources().get("GPU", 0)) < need:
    if time.monotonic() > deadline:
        sys.exit(f"timed out: the cluster has {have:g} of {need} GPUs")
    print(f"waiting for GPUs: {have:g} of {need}", flush=True)
    time.sleep(10)
print(f"cluster has {have:g} GPUs (config needs {need})", flush=True)
PY
exec "$VENV/bin/k3serve" serve --config "$CONFIG" --ray-address auto "$@"
