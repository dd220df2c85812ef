#!/usr/bin/env bash
# GPU tests and benchmarks in one go (H200 machine: torch 2.11+cu130, triton 3.6, fla-core carried in .whl/).
#   OUT=/some/dir bash benchmarks/gpu_all.sh
# Writes pytest.log, gpu_{kda,mla,moe}.{log,json} and gpu.txt under $OUT; each stage has its own time limit.
# On a fresh machine fla compiles and autotunes its KDA kernels per head count and gate mode (~60-90 s
# each): the KDA tests need ~10 minutes; the benchmarks then reuse Triton's disk cache.
set -u
OUT=${OUT:-/tmp/k3serve-gpu}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)' >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
timeout "${PYTEST_S:-900}" python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/pytest.log" | tail -25
for op in ${OPS:-kda mla moe}; do
  timeout "${BENCH_S:-150}" python3 benchmarks/gpu_$op.py --out "$OUT/gpu_$op.json" > "$OUT/gpu_$op.log" 2>&1
  echo "== gpu_$op rc=$?"; tail -30 "$OUT/gpu_$op.log"
done
