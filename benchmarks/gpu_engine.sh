#!/usr/bin/env bash
# The engine on CUDA in one device call (H200 machine; fla-core carried in .whl/):
#   OUT=/some/dir bash benchmarks/gpu_engine.sh
# 1. tests/engine/test_engine_gpu.py (fp32 cuda == cpu; bf16 runs the GPU kernels) then, in the same process
#    (kernels compiled once), tests/engine/test_cuda_graphs_gpu.py (graphs == enforce_eager, replays counted,
#    no host sync); beside them in a second process, tests/kernels/test_kda_gpu.py (all mostly compile
#    fla/Triton kernels on a fresh machine);
# 2. then, alone on the GPU, benchmarks/gpu_decode_step.sh (gpu_engine.py --profile: k3-rank-slice, 12 layers, 8K
#    context, batch 1..64: ours eager, CUDA graphs (wall and device ms), reference, floor, kernels of the replays;
#    DECODE_ARGS passes on).
# Each stage has its own time limit (ENGINE_S, KDA_S, BENCH_S; at most 590 s in all); logs and JSON land in $OUT.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-engine}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
ENGINE_S=${ENGINE_S:-280} KDA_S=${KDA_S:-210} BENCH_S=${BENCH_S:-290}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton, fla; print(torch.__version__, triton.__version__, fla.__version__)' >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
start=$(date +%s)
timeout "$KDA_S" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=0 tests/kernels/test_kda_gpu.py \
  > "$OUT/pytest_kda.log" 2>&1 &
kda_pid=$!
K3SERVE_GPU_REPORT="$OUT/engine_gpu_report.json" timeout "$ENGINE_S" python3 -m pytest -v -s -p no:cacheprovider \
  -m gpu --durations=0 tests/engine/test_engine_gpu.py tests/engine/test_cuda_graphs_gpu.py \
  > "$OUT/pytest_engine.log" 2>&1
echo "== engine gpu tests rc=$? at $(( $(date +%s) - start )) s"; grep -o '{"identical_requests.*' "$OUT/pytest_engine.log"
tail -25 "$OUT/pytest_engine.log"
wait "$kda_pid"
echo "== kda gpu test rc=$? at $(( $(date +%s) - start )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/pytest_kda.log" | tail -25
OUT="$OUT" DECODE_S="$BENCH_S" bash benchmarks/gpu_decode_step.sh
echo "== bench done at $(( $(date +%s) - start )) s"
