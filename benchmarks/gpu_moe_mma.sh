#!/usr/bin/env bash
# The Gluon MMA experts (kernels/moe/gluon_mma.py) measured in one device call on a 2-GPU H200 machine (fla-core
# carried in .whl/), the two GPUs kept apart so no timing shares a GPU with anything:
#   OUT=/some/dir bash benchmarks/gpu_moe_mma.sh
# GPU 0: benchmarks/gpu_moe.py (GEMV, MMA and tensor-core pairs, T1-T192), then the MoE and engine GPU tests.
# GPU 1: the decode step of k3-rank-slice at batch 16 and 64 (graphs), MoE paths A/B: today's (GEMV to 16, then the
#        tensor-core pair), MMA above 16, MMA from 9. Then both GPUs: the NCCL TP2 tests.
# Each stage has its own time limit; logs and JSON land in $OUT.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-moe-mma}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
start=$(date +%s)
stamp() { echo "== $1 rc=$2 at $(( $(date +%s) - start )) s"; }
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 170 python3 benchmarks/gpu_moe.py --out "$OUT/gpu_moe.json" > "$OUT/gpu_moe.log" 2>&1; stamp gpu_moe $?
  timeout 170 python3 -m pytest -n 4 -p no:cacheprovider -q -rfEs -m gpu tests/kernels/test_moe_mma_gpu.py \
    tests/kernels/test_moe_gpu.py tests/engine/test_prefill_memory_gpu.py > "$OUT/pytest_moe.log" 2>&1
  stamp "pytest moe+memory" $?
) &
(
  export CUDA_VISIBLE_DEVICES=1
  for variant in "dot:--moe-mma-max-tokens 0" "mma17:--moe-mma-max-tokens 64" \
                 "mma9:--moe-gemv-max-tokens 8 --moe-mma-max-tokens 64"; do
    name=${variant%%:*}
    timeout 110 python3 benchmarks/gpu_engine.py --batches 16,64 --reference-cap-s 1 --budget-s 90 ${variant#*:} \
      --out "$OUT/decode_$name.json" > "$OUT/decode_$name.log" 2>&1; stamp "decode $name" $?
  done
) &
wait
K3SERVE_TP_NCCL=1 timeout 90 python3 -m pytest -p no:cacheprovider -q -rfEs -m gpu tests/engine/test_tp_nccl_gpu.py \
  tests/engine/test_tp_engine.py > "$OUT/pytest_tp.log" 2>&1; stamp "pytest tp nccl" $?
grep -E "^\| moe|passed|failed" "$OUT"/gpu_moe.log "$OUT"/pytest_*.log
grep -hE "N16: ours|N64: ours|MoE" "$OUT"/decode_*.log
