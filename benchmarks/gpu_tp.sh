#!/usr/bin/env bash
# Tensor parallelism over NCCL with CUDA graphs, in one device call on a 2-GPU machine (fla-core carried in .whl/):
#   OUT=/some/dir bash benchmarks/gpu_tp.sh
# 1. tests/engine/test_tp_nccl_gpu.py (TP2 on cuda:0 + cuda:1: NCCL on both ranks, graphs captured and replayed
#    alike on both, tokens against TP1 eager), tests/engine/test_tp_engine.py -m gpu (TP2 fp32 == TP1: NCCL,
#    the default, eager; K3SERVE_TP_NCCL=1 on this stage overrides an opt-out the caller's environment may
#    hold) and the capture tests of tests/engine/test_cuda_graphs_gpu.py (TP1 capture and its fallback);
# 2. benchmarks/gpu_tp.py: TP2 decode step latency, model collectives on gloo (the opt-out, K3SERVE_TP_NCCL=0)
#    vs NCCL eager vs NCCL with graphs, batch 1 / 8 / 16 (BATCHES passes on), one table.
# Each stage has its own time limit (TEST_S, BENCH_S; at most 590 s in all); logs and JSON land in $OUT.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-tp}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
TEST_S=${TEST_S:-330} BENCH_S=${BENCH_S:-240}
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset} NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
  python3 -c 'import torch, triton, fla; print(torch.__version__, torch.cuda.nccl.version(), triton.__version__)'
  python3 -c 'import torch, fla; print("fla", fla.__version__, "GPUs", torch.cuda.device_count())'; } > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
start=$(date +%s)
K3SERVE_TP_NCCL=1 timeout "$TEST_S" python3 -m pytest -v -s -p no:cacheprovider -m gpu --durations=0 tests/engine/test_tp_nccl_gpu.py \
  tests/engine/test_tp_engine.py tests/engine/test_cuda_graphs_gpu.py -k "tp2 or replays_equal or falls_back" \
  > "$OUT/pytest_tp.log" 2>&1
echo "== tp gpu tests rc=$? at $(( $(date +%s) - start )) s"; grep -o '{"first_tokens_equal.*' "$OUT/pytest_tp.log"
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Warning|warn" "$OUT/pytest_tp.log" | tail -25
timeout "$BENCH_S" python3 benchmarks/gpu_tp.py --batches "${BATCHES:-1,8,16}" --out "$OUT/gpu_tp.json" \
  > "$OUT/gpu_tp.log" 2>&1
echo "== tp bench rc=$? at $(( $(date +%s) - start )) s"; grep -v '^USDT' "$OUT/gpu_tp.log" | tail -20
