#!/usr/bin/env bash
# The KDA short conv on CUDA in one device call (H200 machine, under a minute):  OUT=/some/dir bash benchmarks/gpu_conv_prefill.sh
# 1. its GPU tests (tests/kernels/test_conv_gpu.py: the decode step and the prefill step match the reference at K3's
#    rank shape, the prefill ran the Triton kernel without a host sync);
# 2. benchmarks/gpu_conv_prefill.py: a prefill step's time and peak memory, Triton vs the torch reference loop.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-conv}
mkdir -p "$OUT"
[ "${NCCL_NVLS_ENABLE:-}" = 0 ] || source benchmarks/_gpu_env.sh
timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu tests/kernels/test_conv_gpu.py > "$OUT/pytest_conv.log" 2>&1
echo "== conv gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/pytest_conv.log" | tail -20
timeout 150 python3 benchmarks/gpu_conv_prefill.py --out "$OUT/gpu_conv_prefill.json" 2>&1 | tee "$OUT/gpu_conv_prefill.log" | tail -12
