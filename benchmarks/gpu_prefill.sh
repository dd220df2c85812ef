#!/usr/bin/env bash
# KDA checkpointed prefill and model prefill TTFT in one device call (1-GPU H200 machine; fla-core carried in .whl/):
#   OUT=/some/dir bash benchmarks/gpu_prefill.sh
# 1. benchmarks/gpu_kda.py --ops prefill: ours + in-pass checkpoint vs fla chunk_kda vs fla split, 8K tokens,
#    12 / 96 / 32 heads (on a fresh machine fla compiles and autotunes per head count, ~60-90 s each; its
#    autotune results go to Triton's disk cache, which the next two stages reuse);
# 2. the checkpoint tests of tests/kernels/test_kda_gpu.py (resume precision at H12/32/96, no device sync,
#    the 8K varlen checkpoints with the bounded gate);
# 3. benchmarks/gpu_prefill.py: 8K-token prompt through k3-rank-slice, in-pass vs split checkpoint, with
#    whatever time is left of TOTAL_S.
# Writes gpu.txt, gpu_kda.{log,json}, pytest_kda.log, gpu_prefill.{log,json} under $OUT.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-prefill}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
TOTAL_S=${TOTAL_S:-520} KDA_S=${KDA_S:-280} TEST_S=${TEST_S:-120}
start=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)' >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
timeout "$KDA_S" python3 benchmarks/gpu_kda.py --ops prefill --heads 12,96,32 --out "$OUT/gpu_kda.json" \
  > "$OUT/gpu_kda.log" 2>&1
echo "== gpu_kda rc=$? at $(( $(date +%s) - start )) s"; tail -12 "$OUT/gpu_kda.log"
timeout "$TEST_S" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=0 tests/kernels/test_kda_gpu.py \
  -k "resume or never_syncs or safe-gate" > "$OUT/pytest_kda.log" 2>&1
echo "== kda checkpoint tests rc=$? at $(( $(date +%s) - start )) s"
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$OUT/pytest_kda.log" | tail -15
timeout "$(left)" python3 benchmarks/gpu_prefill.py --out "$OUT/gpu_prefill.json" > "$OUT/gpu_prefill.log" 2>&1
echo "== gpu_prefill rc=$? at $(( $(date +%s) - start )) s"; tail -14 "$OUT/gpu_prefill.log"
