#!/usr/bin/env bash
# The fused small ops on CUDA in one device call (H200 machine):  OUT=/some/dir bash benchmarks/gpu_small_ops.sh
# 1. their GPU tests (Triton backend ran, matches the torch reference at K3 shapes, batch 1/64/1000);
# 2. benchmarks/gpu_small_ops.py: device us per call and kernels per call, Triton vs reference, batch 1 and 64.
# Then benchmarks/gpu_engine.sh measures the whole decode step.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-small-ops}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
timeout 300 python3 -m pytest -v -p no:cacheprovider -m gpu tests/kernels/test_attn_res_gpu.py \
  tests/kernels/test_router_gpu.py tests/kernels/test_kda_gate_gpu.py tests/kernels/test_glu_gpu.py > "$OUT/pytest_small_ops.log" 2>&1
echo "== small-op gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/pytest_small_ops.log" | tail -30
timeout 200 python3 benchmarks/gpu_small_ops.py --json "$OUT/gpu_small_ops.json" 2>&1 | tee "$OUT/gpu_small_ops.log" | tail -12
