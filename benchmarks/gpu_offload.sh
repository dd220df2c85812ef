#!/usr/bin/env bash
# The offload tiers' TTFT on the GPU (issue 22): a 4K prompt whose 3.5K prefix is a hit in each tier, against no
# hit, in one run (benchmarks/offload_ttft.py), on K3_TINY_GPU (k3-tiny at K3's head sizes) in bf16; a
# mooncake_master is started on loopback by the script. Writes benchmarks/results/$OUT/offload_ttft.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-h200-$(date +%Y-%m-%d)}
CKPT=${CKPT:-/tmp/k3-tiny-gpu}
[ -f "$CKPT/config.json" ] || python -c "
from k3serve.model.checkpoint import make_checkpoint; from k3serve.model.presets import K3_TINY_GPU
make_checkpoint(K3_TINY_GPU, '$CKPT', seed=0)"
python benchmarks/offload_ttft.py --device cuda --model "$CKPT" --runs 5 --out "benchmarks/results/$OUT/offload_ttft.json"
