#!/usr/bin/env bash
# The memory plan against the H200 in one device call (1-GPU H200 machine; fla-core carried in .whl/):
#   OUT=/some/dir bash benchmarks/gpu_memory_plan.sh
# 1. tests/engine/test_warmup_gpu.py and test_prefill_memory_gpu.py (the start's check passes on K3_TINY_GPU and
#    fails an under-estimating plan; one prefill step within its estimate): ~2 min on a fresh machine;
# 2. benchmarks/gpu_memory_plan.py: k3-rank-slice (12 layers of K3 at TP8), planned vs measured by component,
#    one JSON line each (build ~1 min, graphs, two 32K-token warm-up steps), with whatever time is left of TOTAL_S.
# Writes gpu.txt, pytest_memory.log, gpu_memory_plan.{log,json} under $OUT.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-memory-plan}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
TOTAL_S=${TOTAL_S:-560} TEST_S=${TEST_S:-240}
start=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)' >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
timeout "$TEST_S" python3 -m pytest -v -s -p no:cacheprovider -m gpu tests/engine/test_warmup_gpu.py \
  tests/engine/test_prefill_memory_gpu.py > "$OUT/pytest_memory.log" 2>&1
echo "== memory gpu tests rc=$? at $(( $(date +%s) - start )) s"
grep -E "warm-up step|prefill step|PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_memory.log" | tail -12
timeout "$(left)" python3 benchmarks/gpu_memory_plan.py --out "$OUT/gpu_memory_plan.json" > "$OUT/gpu_memory_plan.log" 2>&1
echo "== gpu_memory_plan rc=$? at $(( $(date +%s) - start )) s"; tail -14 "$OUT/gpu_memory_plan.log"
