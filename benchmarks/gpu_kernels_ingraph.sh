#!/usr/bin/env bash
# The decode kernels timed inside CUDA graphs, in one device call (H200 machine):
#   OUT=/some/dir bash benchmarks/gpu_kernels_ingraph.sh
# (it sources benchmarks/_gpu_env.sh unless the caller already did). Every timed kernel is first checked against
# its fp32 reference, then timed eager, as a one-call graph (which also pays the graph's launch, printed under each
# table) and in graph (one call amid a graph cycling over copies of its operands larger than L2):
# 1. gpu_kda.py --ops decode: kda_decode vs fla's fused_recurrent_kda_fwd, N 1-64, H 12 and 32, and our tile sweep;
# 2. gpu_mla.py --sweep: 15 shapes, then at 5 shapes the split rule vs its waves 1/2/4 and explicit split counts;
# 3. gpu_moe.py: the GEMV and tensor-core expert pairs at T 1-64.
# Writes gpu.txt and gpu_{kda_decode,mla,moe}.{log,json} under $OUT. About 4-5 minutes on a fresh machine, much of it
# Triton compiling and autotuning; each stage has a time limit (8 minutes in all) and keeps the rows it printed if cut.
set -u -o pipefail
OUT=${OUT:-/tmp/k3serve-gpu-ingraph}
mkdir -p "$OUT"
[ "${NCCL_NVLS_ENABLE:-}" = 0 ] || source benchmarks/_gpu_env.sh
python3 -c 'import fla' 2>/dev/null || echo "fla does not import (carry .whl/): the KDA stage stops at its anchor"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)' >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
start=$(date +%s)

stage() {  # log name, time limit (s), script and its arguments; the whole log under $OUT, its tail here
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 "$@" --out "$OUT/$name.json" 2>&1 | grep -v USDT | tee "$OUT/$name.log" | tail -n 40
  local rc=${PIPESTATUS[0]}
  echo "== $name rc=$rc at $(( $(date +%s) - start )) s"
}

stage gpu_kda_decode 150 benchmarks/gpu_kda.py --ops decode
stage gpu_mla 180 benchmarks/gpu_mla.py --sweep --splits 4,6,7,8,9,12,16
stage gpu_moe 150 benchmarks/gpu_moe.py
