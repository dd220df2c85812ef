#!/usr/bin/env bash
# A/B of this tree against a base tree on one GPU, in one device call (fla-core carried in .whl/):
#   rm -rf scratch/base && mkdir -p scratch/base && git archive <rev> | tar -x -C scratch/base
#   OUT=/some/dir BASE_DIR=scratch/base [GPU=1] [STAGES="moe decode"] bash benchmarks/gpu_ab.sh
# Alternating base and new on the same GPU: benchmarks/gpu_moe.py (MXFP4 experts, every path, T1-T192), then the
# decode step (gpu_engine.py: k3-rank-slice, graphs, batch 16 and 64); STAGES=mla: benchmarks/gpu_mla.py (its main
# table). Logs (and the MoE / MLA JSON) land in $OUT as {moe,decode,mla}_{base,new}.*; each run has its own time
# limit (MOE_S, DECODE_S, MLA_S).
set -u
OUT=${OUT:-/tmp/k3serve-gpu-ab}
mkdir -p "$OUT"
[ -d "${BASE_DIR:-}" ] || { echo "BASE_DIR must name the base tree (git archive of a revision)"; exit 1; }
source benchmarks/_gpu_env.sh
export CUDA_VISIBLE_DEVICES=${GPU:-0}
SITE=${PYTHONPATH#"$PWD"}
MOE_S=${MOE_S:-110} DECODE_S=${DECODE_S:-90} MLA_S=${MLA_S:-120}
start=$(date +%s)
run() {  # side, what, command...
  local side=$1 what=$2 dir=$PWD; shift 2
  [ "$side" = base ] && dir=$BASE_DIR
  (cd "$dir" && PYTHONPATH="$PWD$SITE" "$@") > "$OUT/${what}_$side.log" 2>&1
  echo "== $what $side rc=$? at $(( $(date +%s) - start )) s"
}
for stage in ${STAGES:-moe decode}; do
  for side in base new; do
    case $stage in
      moe) run $side moe timeout "$MOE_S" python3 benchmarks/gpu_moe.py --out "$OUT/moe_$side.json" ;;
      mla) run $side mla timeout "$MLA_S" python3 benchmarks/gpu_mla.py --out "$OUT/mla_$side.json" ;;
      decode) run $side decode timeout "$DECODE_S" python3 benchmarks/gpu_engine.py --batches 16,64 \
                --reference-cap-s 1 --budget-s $(( DECODE_S - 20 )) ;;
    esac
  done
done
for side in base new; do
  echo "-- $side"; grep -hs "^| moe\|^| mla" "$OUT/moe_$side.log" "$OUT/mla_$side.log"
  grep -hs "N16: ours\|N64: ours" "$OUT/decode_$side.log"
done
