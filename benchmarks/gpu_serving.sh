#!/usr/bin/env bash
# The whole server on the GPU in one device call (one H200; fla-core and the serving wheels carried in .whl/, NIXL
# optionally in .whl-nixl/; no Ray, no network):
#   OUT=/some/dir [STAGES=test,bench] [LAYERS=12] [LAYOUTS=colocated] [CONFIGS=all_on,all_off] [REPS=1]
#   [TIME_S=15] [DRAIN_S=20] [CONC=1,4,16] [TRANSFER=nixl] [TOTAL_S=540] bash benchmarks/gpu_serving.sh
# 1. test:  tests/serving/test_serve_device.py -m gpu (k3serve serve --device cuda --launcher local: colocated, 1P1D
#           transfer local, 1P1D NIXL if carried; each HTTP greedy text == LLM eager on the same checkpoint) and
#           tests/kernels/test_moe_finalize_gpu.py (the unfused finalize at the rank's MoE shapes), TEST_S.
# 2. bench: `k3serve make-checkpoint --preset k3-rank-slice --layers $LAYERS --device cuda` (once, kept in
#           $CKPT_DIR), then benchmarks/gpu_serving.py over LAYOUTS x CONFIGS x REPS (8000 in / 1000 out at CONC,
#           TIME_S a window): JSON lines, summary.json, tables.md and the server logs under $OUT/gpu_serving/.
#           CONFIGS: all_on, all_off, static_budget, align_checkpoints, unfused_finalize, no_graphs,
#           reference_kernels, all_off_reference (gpu_serving.py's docstring); LAYOUTS: colocated, disagg.
# The defaults fit one call: 12 layers (~25 GB written and loaded; LAYERS=4 takes a third), colocated all_on +
# all_off, one repetition. The whole matrix (7 configs x 3 reps x 2 layouts) needs about 40 servers: split it over
# calls (e.g. CONFIGS=all_on,all_off REPS=3, then the one-offs). Nothing starts past TOTAL_S (wall, from here).
# SMOKE=1 runs both stages on the CPU (k3-tiny, short prompts: gpu_serving.py --smoke; the test's CPU variant).
set -u
OUT=${OUT:-/tmp/k3serve-gpu-serving}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh .whl
PY=${PYTHON:-python3} SMOKE=${SMOKE:-0}
if ls .whl-nixl/*.whl >/dev/null 2>&1; then  # beside .whl's site, not instead of it (_gpu_env.sh sets one)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-nixl \
    .whl-nixl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site-nixl"
fi
# One kernel cache for every server this call starts (the test harness gives each server its own HOME)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/k3serve-triton-cache} TRITON_CACHE_AUTOTUNING=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
STAGES=${STAGES:-test,bench} LAYERS=${LAYERS:-12} LAYOUTS=${LAYOUTS:-colocated} CONFIGS=${CONFIGS:-all_on,all_off}
REPS=${REPS:-1} TIME_S=${TIME_S:-15} DRAIN_S=${DRAIN_S:-20} CONC=${CONC:-1,4,16} TRANSFER=${TRANSFER:-nixl}
TOTAL_S=${TOTAL_S:-540} TEST_S=${TEST_S:-200} CKPT_DIR=${CKPT_DIR:-/tmp/k3-rank-slice-$LAYERS}
start=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
[[ $SMOKE == 1 ]] && { nvidia-smi() { echo "no GPU (SMOKE=1)"; }; }
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  $PY -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1
  $PY -c 'import fastapi, starlette, uvicorn, pydantic; print("fastapi", fastapi.__version__, "starlette", starlette.__version__, "uvicorn", uvicorn.__version__, "pydantic", pydantic.__version__)'
  $PY -c 'import nixl_cu13; print("nixl_cu13 from", nixl_cu13.__file__)' 2>&1 | tail -1
  echo "STAGES=$STAGES LAYERS=$LAYERS LAYOUTS=$LAYOUTS CONFIGS=$CONFIGS REPS=$REPS TIME_S=$TIME_S DRAIN_S=$DRAIN_S CONC=$CONC TRANSFER=$TRANSFER TOTAL_S=$TOTAL_S"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# the checkpoint is written beside the tests (host and disk work; the tests' models are small)
ckpt_pid=
if [[ ,$STAGES, == *,bench,* && $SMOKE != 1 && ! -f $CKPT_DIR/config.json ]]; then
  ( $PY -m k3serve.cli make-checkpoint --preset k3-rank-slice --layers "$LAYERS" --device cuda --out "$CKPT_DIR.tmp" \
      > "$OUT/make_checkpoint.log" 2>&1 && mv "$CKPT_DIR.tmp" "$CKPT_DIR" ) &
  ckpt_pid=$!
fi
if [[ ,$STAGES, == *,test,* ]]; then
  marker=gpu; [[ $SMOKE == 1 ]] && marker="not gpu"
  timeout "$TEST_S" $PY -m pytest -v -p no:cacheprovider -m "$marker" --durations=0 tests/serving/test_serve_device.py \
    $( [[ $SMOKE == 1 ]] || echo tests/kernels/test_moe_finalize_gpu.py ) \
    > "$OUT/pytest_serve_device.log" 2>&1
  echo "== serve --device cuda tests rc=$? at $(( $(date +%s) - start )) s"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/pytest_serve_device.log" | tail -12
fi
if [[ ,$STAGES, == *,bench,* ]]; then
  model=(--model "$CKPT_DIR"); [[ $SMOKE == 1 ]] && model=(--smoke)
  if [[ -n $ckpt_pid ]]; then
    wait "$ckpt_pid"
    echo "== checkpoint rc=$? at $(( $(date +%s) - start )) s: $(du -sh "$CKPT_DIR" 2>/dev/null | cut -f1)"
    tail -3 "$OUT/make_checkpoint.log"
  fi
  bench_s=$(( $(left) - 10 ))
  # no server starts once the remaining time is less than one server's start, warm-up and windows
  budget=$(( bench_s - 40 - 3 * (${TIME_S%.*} + 10) ))
  timeout "$bench_s" $PY benchmarks/gpu_serving.py "${model[@]}" --layouts "$LAYOUTS" --configs "$CONFIGS" \
    --reps "$REPS" --time-s "$TIME_S" --drain-s "$DRAIN_S" --concurrency "$CONC" --transfer "$TRANSFER" \
    --budget-s "$(( budget > 0 ? budget : 0 ))" --out "$OUT/gpu_serving" > "$OUT/gpu_serving.log" 2>&1
  echo "== gpu_serving rc=$? at $(( $(date +%s) - start )) s"
  grep -E "^(plan|FAILED|skipped)|: [0-9]+ done" "$OUT/gpu_serving.log" | tail -40
  sed -n '/^### Serving/,$p' "$OUT/gpu_serving.log" | head -80
fi
