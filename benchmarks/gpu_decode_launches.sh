#!/usr/bin/env bash
# Fewer torch launches in the decode step, checked in one device call (one H200):
#   OUT=/some/dir bash benchmarks/gpu_decode_launches.sh
# 1. the GPU tests of the ops that replaced torch launches (sigmoid gate, shard embedding, per-head cuBLAS
#    products, the in-place norm, the MLA cache write of strided rows) and of the model and engine around them;
# 2. benchmarks/count_decode_ops.py on CUDA: the torch launches a decode step still adds, by source line
#    (k3-rank-slice, K3's first 4 layers at TP8, 8192 cached tokens, batch 1).
# test_tp_engine.py runs TP2 over gloo on the one GPU (the TP > 1 paths: shard embedding, fp32 shared experts).
# TP > 1 over NCCL needs two GPUs: tests/engine/test_tp_nccl_gpu.py on nvidia-h200-x2 (not run here).
set -u
OUT=${OUT:-/tmp/k3serve-gpu-decode-launches}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
timeout 400 python3 -m pytest -v -p no:cacheprovider -m gpu tests/kernels/test_gate_gpu.py \
  tests/kernels/test_embedding_gpu.py tests/kernels/test_head_matmul_gpu.py tests/kernels/test_norm_gpu.py \
  tests/kernels/test_mla_gpu.py tests/model/test_stacked_projections.py tests/engine/test_engine_gpu.py \
  tests/engine/test_cuda_graphs_gpu.py tests/engine/test_tp_engine.py > "$OUT/pytest_decode_launches.log" 2>&1
echo "== gpu tests rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/pytest_decode_launches.log" | tail -40
timeout 120 python3 benchmarks/count_decode_ops.py --device cuda --config k3-rank-slice --layers 4 --ctx 8192 \
  --lines 120 --json "$OUT/count_decode_ops_b1.json" 2>&1 | tee "$OUT/count_decode_ops_b1.log"
