#!/usr/bin/env bash
# Structured outputs on the GPU machine in one device call (carry .whl: xgrammar 0.2.8 and what it imports that
# the image lacks, for Python 3.12: apache_tvm_ffi, pydantic, pydantic_core, annotated_types, typing_inspection,
# typing_extensions; the image has torch, triton and transformers):
#   OUT=/some/dir bash benchmarks/gpu_structured_output.sh
# 1. tests/engine/test_structured_output_gpu.py (the mask through xgrammar's CUDA kernel == the host reference,
#    K3's vocabulary; the engine with padded decode graphs, constrained beside unconstrained rows) and, in the
#    same run, tests/engine/test_structured_output.py (the CPU specification, on this machine's xgrammar);
# 2. benchmarks/structured_output_mask.py --device cuda: a step's sampling with 8 of 32 rows constrained, V 512
#    and 163840.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-structured}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
python3 -c 'import torch, triton, xgrammar; print(torch.__version__, triton.__version__, xgrammar.__file__)' \
  | tee "$OUT/versions.txt"
start=$(date +%s)
timeout 360 python3 -m pytest -v -p no:cacheprovider -rs --durations=0 \
  tests/engine/test_structured_output_gpu.py tests/engine/test_structured_output.py > "$OUT/pytest.log" 2>&1
echo "== structured output tests rc=$? at $(( $(date +%s) - start )) s"; tail -40 "$OUT/pytest.log"
timeout 180 python3 benchmarks/structured_output_mask.py --device cuda --steps 300 --out "$OUT/mask_cuda.json" \
  2>&1 | tee "$OUT/mask_cuda.log"
echo "== mask benchmark rc=${PIPESTATUS[0]} at $(( $(date +%s) - start )) s"
