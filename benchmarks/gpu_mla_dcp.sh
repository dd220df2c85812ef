#!/usr/bin/env bash
# One DCP rank's MLA decode (local part + merge) against the unsplit decode, in one device call (H200 machine):
#   OUT=/some/dir bash benchmarks/gpu_mla_dcp.sh
# (it sources benchmarks/_gpu_env.sh unless the caller already did). 18 shapes: contexts 32K/64K/128K, N 1 and 16,
# W 2/4/8, each checked against the unsplit decode (and the fp32 reference up to 32K) before it is timed.
# Writes gpu.txt and gpu_mla_dcp.{log,json} under $OUT; about 2-3 minutes, most of it Triton compiling.
set -u -o pipefail
OUT=${OUT:-/tmp/k3serve-gpu-mla-dcp}
mkdir -p "$OUT"
[ "${NCCL_NVLS_ENABLE:-}" = 0 ] || source benchmarks/_gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
timeout 480 python3 benchmarks/gpu_mla_dcp.py --out "$OUT/gpu_mla_dcp.json" 2>&1 | tee "$OUT/gpu_mla_dcp.log" | tail -n 30
echo "== gpu_mla_dcp rc=${PIPESTATUS[0]}"
