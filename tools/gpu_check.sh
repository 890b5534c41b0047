#!/usr/bin/env bash
# Everything that needs a real GPU, on a machine with NVIDIA's driver, torch
# and no package index:
#
#   tools/gpu_check.sh [build] [gpu] [ucx] [standin] [bench] [bench-quick]   (default: build gpu standin bench)
#
# installs the wheels in .whl/ (tools/gpu_wheels.sh) when there are any,
# builds the extension in place, then runs
#   gpu          pytest -m gpu tests/test_gpu.py: torch tensors and the
#                stand-in suites' scenarios on NVIDIA's driver
#   ucx          the transport "ucx" cases of those, where .whl/ holds the
#                libucx-cu12 wheel (the build then makes the UCX plugin with
#                it): device caches must go by UCX, none staged
#   standin      the device suites on the driver stand-in, as CI runs them
#   bench        python -m datadist_aio.bench --device (bench-quick: --quick)
# Logs, the benchmark's JSON and summary.txt go to $OUT (default
# build/gpu-check). Exits 1 if any step failed; every step runs regardless.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-build/gpu-check}"
mkdir -p "$out"
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(build gpu standin bench)
summary="$out/summary.txt"
: > "$summary"
failed=0
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
# Only the plugins named below: a machine's other pytest plugins stay out.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
pytest=(python3 -m pytest -p pytest_asyncio.plugin -p pytest_timeout -p no:cacheprovider -rs)

step() {  # step NAME LIMIT_S COMMAND...: runs COMMAND with its output in $out/NAME.log
  local name=$1 limit=$2 began rc
  shift 2
  began=$(date +%s)
  timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - began )) s: $*" | tee -a "$summary"
  [ $rc -eq 0 ] || failed=1
  return $rc
}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1
} > "$out/env.log"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu-check-site .whl/*.whl \
    || { echo "installing .whl/ failed" | tee -a "$summary"; exit 1; }
  export PYTHONPATH="/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -d /tmp/gpu-check-site/libucx/lib ]; then  # the libucx-cu12 wheel: UCX built with CUDA
  export CMAKE_PREFIX_PATH="/tmp/gpu-check-site/libucx${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export DATADIST_AIO_UCX_LIB_DIR=/tmp/gpu-check-site/libucx/lib
fi
python3 -c 'import pytest_asyncio' 2> /dev/null || echo "pytest-asyncio is missing: run tools/gpu_wheels.sh where pip reaches an index, and carry .whl" | tee -a "$summary"

for name in "${steps[@]}"; do
  case "$name" in
    build) step build 400 python3 -m pip install --no-build-isolation --no-deps -e . || break ;;
    gpu) step test_gpu 400 "${pytest[@]}" -v -m gpu tests/test_gpu.py
         # Here a skip means the GPU, its driver or torch was not found.
         if grep -q '^SKIPPED' "$out/test_gpu.log"; then echo "test_gpu: skipped tests (see its log)" | tee -a "$summary"; failed=1; fi ;;
    ucx) if [ -z "${DATADIST_AIO_UCX_LIB_DIR:-}" ]; then echo "ucx: no libucx-cu12 wheel in .whl/" | tee -a "$summary"; failed=1; continue; fi
         # Without an RDMA device UCX leaves device memory to the link's own
         # paths; DATADIST_AIO_TEST_UCX_DEVICE=1 asserts that UCX moves it
         # (set it where the GPU's host has one).
         UCX_PROTO_INFO=y step ucx 300 "${pytest[@]}" -v -m gpu tests/test_gpu.py -k ucx
         grep -q '^SKIPPED' "$out/ucx.log" && { echo "ucx: skipped tests (see its log)" | tee -a "$summary"; failed=1; } ;;
    standin) step standin 300 "${pytest[@]}" -q -m "not gpu" tests/test_device_transfer.py tests/test_device_ipc.py \
               tests/test_cuda_events.py tests/test_device_memory.py tests/test_gpu.py ;;
    bench) step bench 400 python3 -m datadist_aio.bench --device --output "$out" ;;
    bench-quick) step bench 200 python3 -m datadist_aio.bench --device --quick --output "$out" ;;
    *) echo "unknown step: $name (build, gpu, ucx, standin, bench, bench-quick)" | tee -a "$summary"; failed=1 ;;
  esac
done
[ -f "$out/bench.log" ] && grep -v '^\[device bench\]' "$out/bench.log" | grep -v 'not authenticated' >> "$summary"
exit $failed
