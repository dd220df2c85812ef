#!/usr/bin/env bash
# Issue 7's decode-step row alone in one device call, no tests (H200; fla-core carried in .whl/):
#   OUT=/some/dir [DECODE_S=330] [DECODE_ARGS="--configs k3-rank-slice,k3-tiny-gpu"] bash benchmarks/gpu_decode_step.sh
# Runs benchmarks/gpu_engine.py --profile: k3-rank-slice (one TP8 rank, K3's first 12 layers), 8192 cached tokens,
# batch 1..64: eager, CUDA graphs, reference (1 / 8 / 64 first), floor, and the kernels of the graph replays at
# batch 1 and 64. Everything ends within DECODE_S seconds: `timeout` stops the benchmark (it then prints and keeps
# what it measured), whose own budget leaves 60 s of that for the last item and the report.
# Output in $OUT: gpu_decode_step.log (tables), gpu_decode_step.json (rows, profiles, skipped), decode_step_gpu.txt.
set -u
start=$(date +%s)
OUT=${OUT:-/tmp/k3serve-gpu-decode-step}
DECODE_S=${DECODE_S:-330}
mkdir -p "$OUT"
# Its own install target (/tmp/site-decode-step): another gpu_*.sh of the same call may be installing into /tmp/site.
ln -sfn .whl .whl-decode-step
source benchmarks/_gpu_env.sh .whl-decode-step
rm -f .whl-decode-step
{ nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}"
  python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)'; } \
  > "$OUT/decode_step_gpu.txt" 2>&1
cat "$OUT/decode_step_gpu.txt"
left=$(( DECODE_S - ($(date +%s) - start) - 10 ))
timeout -k 10 "$left" python3 benchmarks/gpu_engine.py --profile --budget-s $(( left - 60 )) \
  --out "$OUT/gpu_decode_step.json" ${DECODE_ARGS:-} > "$OUT/gpu_decode_step.log" 2>&1
echo "== decode step bench rc=$? at $(( $(date +%s) - start )) s of $DECODE_S"
grep -v '^USDT' "$OUT/gpu_decode_step.log" | tail -80
