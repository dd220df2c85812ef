#!/usr/bin/env bash
# The GPU handoff benchmark in one device call (2-GPU H200 machine; the NIXL wheel carried in .whl-nixl/,
# nothing else: it runs without fla and without ray):
#   OUT=/some/dir bash benchmarks/gpu_handoff.sh
# Runs benchmarks/gpu_handoff.py twice, UCX choosing its transports and with UCX_TLS=cuda_ipc,cuda_copy,tcp;
# writes env.txt, gpu_handoff{,_tls}.{log,json} under $OUT. Each run has its own time limit (HANDOFF_S).
set -u
OUT=${OUT:-/tmp/k3serve-gpu-handoff}
mkdir -p "$OUT"
ls .whl-nixl/*.whl >/dev/null 2>&1 || { echo "no NIXL wheel in .whl-nixl/ (carry it)"; exit 1; }
source benchmarks/_gpu_env.sh .whl-nixl
HANDOFF_S=${HANDOFF_S:-240}
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch, nixl_cu13; print("torch", torch.__version__, "nixl_cu13 from", nixl_cu13.__file__)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
start=$(date +%s)
timeout "$HANDOFF_S" python3 benchmarks/gpu_handoff.py --out "$OUT/gpu_handoff.json" > "$OUT/gpu_handoff.log" 2>&1
echo "== handoff (UCX default transports) rc=$? at $(( $(date +%s) - start )) s"; tail -16 "$OUT/gpu_handoff.log"
UCX_TLS=cuda_ipc,cuda_copy,tcp timeout "$HANDOFF_S" python3 benchmarks/gpu_handoff.py --out "$OUT/gpu_handoff_tls.json" \
  > "$OUT/gpu_handoff_tls.log" 2>&1
echo "== handoff (UCX_TLS=cuda_ipc,cuda_copy,tcp) rc=$? at $(( $(date +%s) - start )) s"; tail -16 "$OUT/gpu_handoff_tls.log"
