#!/usr/bin/env bash
# The engine on CUDA in one device call (H200 machine; fla-core carried in .whl/):
#   OUT=/some/dir bash benchmarks/gpu_engine.sh
# 1. tests/engine/test_engine_gpu.py (fp32 cuda == cpu; bf16 runs the GPU kernels) and, beside it in a
#    second process, tests/kernels/test_kda_gpu.py (both mostly compile fla/Triton kernels on a fresh machine);
# 2. then, alone on the GPU, benchmarks/gpu_engine.py (decode step, ours vs reference vs floor).
# Each stage has its own time limit (ENGINE_S, KDA_S, BENCH_S); logs and JSON land in $OUT.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-engine}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ENGINE_S=${ENGINE_S:-200} KDA_S=${KDA_S:-210} BENCH_S=${BENCH_S:-140}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)' >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
start=$(date +%s)
timeout "$KDA_S" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=0 tests/kernels/test_kda_gpu.py \
  > "$OUT/pytest_kda.log" 2>&1 &
kda_pid=$!
K3SERVE_GPU_REPORT="$OUT/engine_gpu_report.json" timeout "$ENGINE_S" python3 -m pytest -v -s -p no:cacheprovider \
  -m gpu --durations=0 tests/engine/test_engine_gpu.py > "$OUT/pytest_engine.log" 2>&1
echo "== engine gpu test rc=$? at $(( $(date +%s) - start )) s"; tail -20 "$OUT/pytest_engine.log"
wait "$kda_pid"
echo "== kda gpu test rc=$? at $(( $(date +%s) - start )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_kda.log" | tail -25
timeout "$BENCH_S" python3 benchmarks/gpu_engine.py --configs k3-rank-slice,k3-tiny-gpu --out "$OUT/gpu_engine.json" \
  --budget-s $(( BENCH_S - 45 )) > "$OUT/gpu_engine.log" 2>&1
echo "== bench rc=$? at $(( $(date +%s) - start )) s"; tail -25 "$OUT/gpu_engine.log"
