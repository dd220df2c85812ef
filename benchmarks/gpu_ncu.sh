#!/usr/bin/env bash
# Nsight Compute on the ops whose goals issue 7 still misses (targets in benchmarks/gpu_ncu_targets.py), one call:
#   OUT=/some/dir [TARGETS="mla kda ..."] bash benchmarks/gpu_ncu.sh
# Per target: one launch of each of its kernels after warm-up (compiled, checked against the reference first):
# speed of light (DRAM and SM throughput), occupancy, warp stall reasons, memory workload, scheduler, launch.
# Clocks left alone (--clock-control none); caches flushed before each profiled launch (ncu's default).
# Writes $OUT/ncu.txt (every report) and prints a digest. Without ncu on the machine it says so.
set -u
OUT=${OUT:-/tmp/k3serve-gpu-ncu}
mkdir -p "$OUT"
source benchmarks/_gpu_env.sh
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine (PATH, /usr/local/cuda*/bin, /opt/nvidia/nsight-compute)"; exit 1; }
TARGETS=${TARGETS:-"mla kda moe_gemv1 moe_gemv16 moe_mma64 linear"}
declare -A KERNELS=([mla]="_decode_kernel|_merge_kernel" [kda]="_kda_decode_kernel" [moe_gemv1]="gemv_(up|down)_kernel"
                    [moe_gemv16]="gemv_(up|down)_kernel" [moe_mma64]="mma_(up|down)_kernel" [linear]="_skinny_kernel")
declare -A PER_CALL=([mla]=2 [kda]=1 [moe_gemv1]=2 [moe_gemv16]=2 [moe_mma64]=2 [linear]=1)
: > "$OUT/ncu.txt"
for t in $TARGETS; do
  n=${PER_CALL[$t]}
  echo "######## $t" >> "$OUT/ncu.txt"
  (cd benchmarks && "$NCU" --clock-control none --kernel-name regex:"${KERNELS[$t]}" --launch-skip $((4 * n)) \
    --launch-count "$n" --section SpeedOfLight --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section SchedulerStats --section LaunchStats \
    python3 gpu_ncu_targets.py "$t") >> "$OUT/ncu.txt" 2>&1
  echo "== $t ncu rc=$?"
done
grep -E "^######## |experts hit|check|  [_a-z]+kernel|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Thr|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Grid Size|Block Size|Waves Per SM|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps|Warp Cycles Per Issued|Dynamic Shared|L2 Hit Rate|Mem Busy|Max Bandwidth|Error|error" "$OUT/ncu.txt" | head -300
