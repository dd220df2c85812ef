#!/usr/bin/env bash
# The GPU handoff benchmark with the Mooncake backend in one device call (2-GPU H200 machine, no network).
# Carry .whl-mooncake/: the mooncake-transfer-engine-cuda13 wheel, and in debs/ the Debian packages
# libibverbs1, ibverbs-providers, libnl-3-200, libnl-route-3-200, libnuma1 (the wheel links libibverbs.so.1
# and libmlx5.so.1 even when it only speaks TCP, and the image has neither):
#   OUT=/some/dir bash benchmarks/gpu_handoff_mooncake.sh
# Runs benchmarks/gpu_handoff.py --backend mooncake twice: protocol tcp (the path measured before, staged
# through the host at ~1.5 GB/s, hence few reps) and protocol nvlink_intra (Mooncake's intra-node NVLink
# transport, built into this wheel, untried here: a short limit). Writes env.txt and
# mooncake_{tcp,nvlink_intra}.{log,json} under $OUT. Each run has its own time limit (TCP_S, INTRA_S).
set -u
OUT=${OUT:-/tmp/k3serve-gpu-handoff-mooncake}
mkdir -p "$OUT"
ls .whl-mooncake/*.whl .whl-mooncake/debs/*.deb >/dev/null 2>&1 || { echo "no wheel or debs in .whl-mooncake/ (carry it)"; exit 1; }
TCP_S=${TCP_S:-150} INTRA_S=${INTRA_S:-50} REPS=${REPS:-10} WARMUP=${WARMUP:-2}

# The RDMA user-space libraries, unpacked beside the system (never into /).
IBV=/tmp/ibv
rm -rf "$IBV" && mkdir -p "$IBV"
for deb in .whl-mooncake/debs/*.deb; do dpkg -x "$deb" "$IBV" || exit 1; done
source benchmarks/_gpu_env.sh .whl-mooncake
# engine.so links libcudart.so.13 by name: the copy torch's CUDA wheels installed (torch preloads it too).
CUDART_DIR=$(python3 -c 'import glob, os, site
hits = [p for d in site.getsitepackages() for p in glob.glob(os.path.join(d, "nvidia", "**", "libcudart.so.13*"), recursive=True)]
print(os.path.dirname(hits[0]) if hits else "")')
export LD_LIBRARY_PATH="$IBV/usr/lib/x86_64-linux-gnu:$IBV/lib/x86_64-linux-gnu${CUDART_DIR:+:$CUDART_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export IBV_DRIVERS=$IBV/usr/lib/x86_64-linux-gnu/libibverbs
{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  if [ -f "$SITE/mooncake/engine.so" ]; then
    ldd "$SITE/mooncake/engine.so" | grep "not found" || echo "engine.so: every linked library found"
  else echo "no $SITE/mooncake/engine.so"; fi
} > "$OUT/env.txt" 2>&1
python3 -c 'import importlib.metadata as md, torch
from mooncake.engine import TransferEngine
print("torch", torch.__version__, "| mooncake", md.version("mooncake-transfer-engine-cuda13"), "imports:", TransferEngine)' \
  >> "$OUT/env.txt" 2>&1
import_rc=$?
cat "$OUT/env.txt"
[ "$import_rc" = 0 ] || { echo "mooncake does not import (see above): no benchmark run"; exit 1; }

handoff() {  # PROTOCOL LIMIT_S: one benchmark run, its table and Mooncake's warnings/errors
  local protocol=$1 limit=$2 start
  start=$(date +%s)
  timeout -k 10 "$limit" python3 benchmarks/gpu_handoff.py --backend mooncake --backend-opt "protocol=$protocol" \
    --reps "$REPS" --warmup "$WARMUP" --out "$OUT/mooncake_$protocol.json" > "$OUT/mooncake_$protocol.log" 2>&1
  echo "== mooncake protocol=$protocol rc=$? in $(( $(date +%s) - start )) s"
  # Mooncake falls back to TCP (logging an error) for a protocol this build lacks: show which transport ran.
  grep -i -E '^I[0-9]{4} .*(nvlink|protocol|transport)' "$OUT/mooncake_$protocol.log" | sort -u -k5 | head -5
  grep -v '^I[0-9]\{4\} ' "$OUT/mooncake_$protocol.log" | tail -20
}
handoff tcp "$TCP_S"
handoff nvlink_intra "$INTRA_S"
