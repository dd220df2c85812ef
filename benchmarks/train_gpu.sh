#!/usr/bin/env bash
# Train the embedded K3-architecture model, or its EAGLE drafter, on one H200 in one device call
# (docs/design/trained_model.md):
#   OUT=/some/dir bash benchmarks/train_gpu.sh                  the k3-code recipe (4000 steps; 4-7 min expected)
#   OUT=/some/dir TRAINER=drafter bash benchmarks/train_gpu.sh  the k3-code-eagle drafter of model/assets/k3-code
#   OUT=/some/dir STEPS=60 bash benchmarks/train_gpu.sh         a probe (STEPS >= 20): times a step, exports a poor checkpoint
# TRAIN_S (default 470) stops the loop after the step that crosses it, so tokenizer training, the final
# evaluation and the export still fit the call's 600 s; results.json then records stopped_at_step. TRAIN_ARGS
# passes more `--set FIELD=VALUE` overrides; RECIPE, DEVICE and PYTHON (defaults: the trainer's recipe, cuda,
# python3) let the same script run the micro recipes on a CPU. What comes back in $OUT (at most 8 files, 16 MiB each):
#   train.log, results.json, loss.png, train_log.jsonl and run.tar.00, run.tar.01 (the whole run folder:
#   checkpoint/, tokenizer/, command.txt; `cat run.tar.* | tar x` restores it).
set -u -o pipefail
OUT=${OUT:-/tmp/k3serve-train}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
RUN=/tmp/k3serve-train-run
rm -rf "$RUN"
PYTHON=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import sys, torch, tokenizers; print(sys.version.split()[0], torch.__version__, tokenizers.__version__)'
timeout 120 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/tools/test_train_gpu.py 2>&1 | tail -3 \
  | tee "$OUT/train.log"  # the trainers on CUDA equal them on the CPU (a failure is logged; the run goes on)
if [ "${TRAINER:-target}" = drafter ]; then
  TRAIN=(-m tools.train.draft --target model/assets/k3-code --recipe "${RECIPE:-k3-code-eagle}")
  PROBE="eval_every=20 warmup_steps=10"
else
  TRAIN=(-m tools.train --recipe "${RECIPE:-k3-code}")
  PROBE="eval_every=20 warmup_steps=10 qat_steps=10"
fi
"$PYTHON" "${TRAIN[@]}" --out "$RUN" --device "${DEVICE:-cuda}" --time-limit-s "${TRAIN_S:-470}" \
  --set ${STEPS:+steps=$STEPS} ${STEPS:+$PROBE} ${TRAIN_ARGS:-} 2>&1 | tee -a "$OUT/train.log"
rc=$?
cp "$RUN/results.json" "$RUN/loss.png" "$RUN/train_log.jsonl" "$OUT/" 2>/dev/null
tar -C "$RUN" -cf - . | split -b 15M -d - "$OUT/run.tar."
ls -la "$OUT"
exit "$rc"
