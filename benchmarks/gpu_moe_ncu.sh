#!/usr/bin/env bash
# Nsight Compute on the Gluon MMA experts (kernels/moe/gluon_mma.py) in one device call (fla-core not needed):
#   OUT=/some/dir [T=192] bash benchmarks/gpu_moe_ncu.sh
# One EP rank at K3 shapes (latent 3584, intermediate 3072, 112 local of 896 experts, top-16), T tokens of random
# routing; the up and down kernels of the 4th call profiled (the first ones compile and warm up): speed of light
# (DRAM and SM throughput), occupancy, warp stall reasons, memory workload. Without ncu on the machine it says so.
# Writes $OUT/ncu_moe_mma.txt.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-moe-ncu}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"; exit 1; }
cat > /tmp/moe_mma_target.py <<'PY'
import functools, os, sys
import torch
sys.path.insert(0, "benchmarks")
from gpu_moe import random_mxfp4
from k3serve.kernels.moe import ExpertWeights, situ_glu, triton_moe
E, I, D, TOP_K, TOTAL, T = 112, 3072, 3584, 16, 896, int(os.environ.get("T", "192"))
dev = torch.device("cuda")
torch.manual_seed(0)
w = ExpertWeights(random_mxfp4(E, I, D, dev=dev), random_mxfp4(E, I, D, dev=dev), random_mxfp4(E, D, I, dev=dev))
x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
ids = torch.stack([torch.randperm(TOTAL, device=dev)[:TOP_K] for _ in range(T)])
tw = torch.rand(T, TOP_K, device=dev)
for _ in range(5):
    triton_moe.fused_experts(x, w, tw, ids, functools.partial(situ_glu, beta=4.0, linear_beta=25.0), 0, path="mma")
torch.cuda.synchronize()
print("experts hit", int(torch.unique(ids[ids < E]).numel()), "rows", int((ids < E).sum()))
PY
"$NCU" --kernel-name regex:"mma_(up|down)_kernel" --launch-skip 6 --launch-count 2 --section SpeedOfLight \
  --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
  python3 /tmp/moe_mma_target.py > "$OUT/ncu_moe_mma.txt" 2>&1
echo "== ncu rc=$?"; grep -E "experts hit|mma_|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Duration" "$OUT/ncu_moe_mma.txt" | head -60
