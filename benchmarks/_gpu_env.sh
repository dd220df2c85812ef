# Sourced by the benchmarks/gpu_*.sh scripts, from the repository root on the GPU machine:
#   source benchmarks/_gpu_env.sh [WHEEL_DIR]       (default .whl; .whl-nixl installs into /tmp/site-nixl)
# Installs the wheels carried in WHEEL_DIR (the GPU machine has no network), puts the repository and them
# on PYTHONPATH, and sets what the machine's rules ask for (NVLink multicast off).
WHEELS=${1:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=/tmp/site${WHEELS#.whl}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$SITE"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
