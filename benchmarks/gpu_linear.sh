#!/usr/bin/env bash
# The skinny GEMM on CUDA in one device call (H200 machine):  OUT=/some/dir bash benchmarks/gpu_linear.sh
# 1. its GPU tests (Triton ran at every K3 rank weight and 1-16 rows, matches fp32 sums, CUDA graph replay, the tile
#    rule's picks fit the device, the fallbacks for smaller shared memory run and match);
# 2. benchmarks/gpu_linear.py: ours vs cuBLAS per weight and row count, the router's fp32 logits three ways, then every
#    candidate tiling at 1 and 16 rows: the rule's pick vs the fastest of the same run (the last table).
# About 2-3 minutes, most of it compiling and timing the candidates.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-linear}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_linear_gpu.py > "$OUT/pytest_linear.log" 2>&1
echo "== linear gpu tests rc=$?"; grep -E "FAILED|ERROR|passed|failed|Error" "$OUT/pytest_linear.log" | tail -30
timeout 240 python3 benchmarks/gpu_linear.py --out "$OUT/gpu_linear.json" 2>&1 | tee "$OUT/gpu_linear.log" | tail -40
