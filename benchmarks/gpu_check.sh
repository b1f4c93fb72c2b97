#!/usr/bin/env bash
# The one script to run on a GPU machine (see docs/benchmarks.md): builds for sm_90, runs the core tests
# on the CUDA backend (plain and under compute-sanitizer), builds and installs the Python package, runs the
# pytest suite and the demo on the device. Logs go to $OUT (default: build/gpu-logs).
# Usage: OUT=/some/dir benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-logs}"
mkdir -p "$OUT"
status=0
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }
run() {  # run NAME CMD...: log to $OUT/NAME.log, record pass/fail in the summary
  local name=$1; shift
  if "$@" >"$OUT/$name.log" 2>&1; then echo "   ok   $name" | tee -a "$OUT/summary.txt"
  else echo "   FAIL $name (see $name.log)" | tee -a "$OUT/summary.txt"; status=1; fi
}

step "machine"
{ nvidia-smi; nvcc --version; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } \
  >"$OUT/machine.log" 2>&1

GTEST_ARGS=()
if [[ ! -e /usr/include/gtest/gtest.h && -d .gtest/googletest ]]; then
  GTEST_ARGS=(-DLAYERSTREAM_GTEST_SOURCE="$PWD/.gtest/googletest")
fi
step "build core tests (sm_90)"
run configure cmake -S . -B build/gpu -G Ninja -DLAYERSTREAM_BUILD_TESTS=ON -DLAYERSTREAM_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=RelWithDebInfo "${GTEST_ARGS[@]}"
run build cmake --build build/gpu

step "core tests"
run ctest ctest --test-dir build/gpu --output-on-failure -j 8
run cuda_tests_verbose build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda'
run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
  build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda'
run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
  build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda'

step "python package"
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90"
run pip_install python3 -m pip install --no-build-isolation --no-deps -v .
run pytest bash -c 'cd /tmp && python3 -m pytest -q -rs '"$PWD"'/tests/python'
run demo_cuda layerstream demo --backend cuda
run demo_cuda_large layerstream demo --backend cuda --hidden 3072 --blocks 4 --steps 3 --no-verify
run demo_sim layerstream demo --backend sim

cat "$OUT/summary.txt"
exit $status
