#!/usr/bin/env bash
# The one script to run on a GPU machine (see docs/benchmarks.md): builds for sm_90, runs the core tests
# on the CUDA backend (plain and under compute-sanitizer), builds and installs the Python package, runs the
# pytest suite and the demo on the device. Logs: $OUT/summary.txt and $OUT/all.log (default OUT:
# build/gpu-logs).
# Usage: OUT=/some/dir benchmarks/gpu_check.sh [all|tests|core|py|bench]   (one lent-machine call has 10
# minutes: run `tests` (= core + py) and `bench` as separate calls there, or `core`, `py`, `bench`)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-logs}"
WHAT="${1:-all}"
mkdir -p "$OUT"
status=0
# Every step's output goes to $OUT/all.log under a header (few files come back from a lent machine);
# $OUT/summary.txt gets one line per step, and the tail of any failing step.
step() { echo "== $*" | tee -a "$OUT/summary.txt"; }
run() {  # run NAME CMD...
  local name=$1; shift
  local log="$OUT/$name.tmp"
  if "$@" >"$log" 2>&1; then echo "   ok   $name" | tee -a "$OUT/summary.txt"
  else
    echo "   FAIL $name" | tee -a "$OUT/summary.txt"
    tail -n 40 "$log" | sed 's/^/      /' >>"$OUT/summary.txt"
    status=1
  fi
  { echo; echo "################ $name: $*"; cat "$log"; } >>"$OUT/all.log"
  rm -f "$log"
}

step "machine"
{ nvidia-smi; nvcc --version; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } \
  >>"$OUT/all.log" 2>&1

# Build with the system compiler when the image points CC/CXX elsewhere: a toolchain that links libstdc++
# statically gives the extension a second copy of it beside the one torch and numpy load, and iostreams
# crash inside that copy (seen on the lent H200 image, whose CXX is /opt/gcc/bin/g++).
if [[ -x /usr/bin/g++ && "${CXX:-/usr/bin/g++}" != /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi

GTEST_ARGS=()
if [[ ! -e /usr/include/gtest/gtest.h && -d .gtest/googletest ]]; then
  GTEST_ARGS=(-DLAYERSTREAM_GTEST_SOURCE="$PWD/.gtest/googletest")
fi
# Optional extras travel as wheels (.whl, git-ignored) and AI-Toolkit's memory_management as .aitk/<commit>
# (git-ignored, never committed): see docs/benchmarks.md for how to prepare both.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && rm -rf /tmp/site/test /tmp/site/bin && export PYTHONPATH=/tmp/site
fi
if compgen -G ".aitk/*/" >/dev/null; then
  AI_TOOLKIT_DIR=$(ls -d "$PWD"/.aitk/*/ | sed 's:/$::' | paste -sd:)
  export AI_TOOLKIT_DIR
fi
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90"

if [[ $WHAT == all || $WHAT == tests || $WHAT == core ]]; then
step "build core tests (sm_90)"
run configure cmake -S . -B build/gpu -G Ninja -DLAYERSTREAM_BUILD_TESTS=ON -DLAYERSTREAM_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=RelWithDebInfo "${GTEST_ARGS[@]}"
run build cmake --build build/gpu

step "core tests"
run ctest ctest --test-dir build/gpu --output-on-failure -j 8
run cuda_tests_verbose build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda'
# The oversized-allocation test provokes cudaErrorMemoryAllocation on purpose; the sanitizer would report it.
run memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
  build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda:-*Oversized*'
run racecheck compute-sanitizer --tool racecheck --error-exitcode 1 \
  build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda:-*Oversized*'
run synccheck compute-sanitizer --tool synccheck --error-exitcode 1 \
  build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*/cuda:-*Oversized*'
fi

if [[ $WHAT == all || $WHAT == tests || $WHAT == py ]]; then
step "python package"
run pip_install python3 -m pip install --no-build-isolation --no-deps -v .
# The equality suite on the GPU under the three sanitizers (cuda cases only), each in its own process, all
# three started in the background beside the plain pytest run so that the stage fits in one lent-machine
# call; each is capped, and a capped run says so in the summary (FAIL with "timeout" in its tail).
# racecheck (shared-memory hazards inside kernels) is the slowest: it gets the linear and conv equality
# cases of one dtype; memcheck and synccheck get the whole equality suite.
san() {  # san TOOL K-EXPRESSION
  local tool=$1 k=$2
  ( cd /tmp && LAYERSTREAM_TEST_DEADLINE_S=0 timeout "${LAYERSTREAM_SANITIZER_S:-480}" compute-sanitizer \
      --tool "$tool" --error-exitcode 1 --target-processes all python3 -m pytest -q -x -p no:cacheprovider \
      -k "$k" "$OLDPWD/tests/python/test_manager_contract.py" ) >"$OUT/pytest_$tool.log" 2>&1
  echo $? >"$OUT/pytest_$tool.rc"
}
EQUALITY="cuda and (bitwise or accumulate)"
san memcheck "$EQUALITY" &
san synccheck "$EQUALITY" &
san racecheck "cuda and bitwise and dtype1" &
# The install/uninstall round trips are file handling with no device code (CI runs them); skipped here to
# leave the call's time to the device tests.
run pytest bash -c 'cd /tmp && python3 -X faulthandler -m pytest -q -rs --durations=12 -p no:cacheprovider \
  -k "not install_then_uninstall" '"$PWD"'/tests/python'
wait
for tool in memcheck synccheck racecheck; do
  rc=$(cat "$OUT/pytest_$tool.rc" 2>/dev/null || echo missing)
  if [[ $rc == 0 ]]; then echo "   ok   pytest_$tool: $(grep -E 'passed|failed' "$OUT/pytest_$tool.log" | tail -1)" | tee -a "$OUT/summary.txt"
  else
    [[ $rc == 124 ]] && rc="124 (timeout after ${LAYERSTREAM_SANITIZER_S:-480} s)"
    echo "   FAIL pytest_$tool rc=$rc" | tee -a "$OUT/summary.txt"
    tail -n 25 "$OUT/pytest_$tool.log" | sed 's/^/      /' >>"$OUT/summary.txt"; status=1
  fi
done

run demo_cuda layerstream demo --backend cuda
run demo_cuda_large layerstream demo --backend cuda --hidden 3072 --blocks 4 --steps 3 --no-verify
fi

if [[ ($WHAT == all || $WHAT == bench) && -n "${AI_TOOLKIT_DIR:-}" ]]; then
  python3 -c 'import layerstream.manager_modules' 2>/dev/null || run pip_install python3 -m pip install --no-build-isolation --no-deps .
  step "reliability figures (cycles, long run)"
  run reliability python3 benchmarks/reliability.py --json-out "$OUT/reliability.json"
  step "per-call host overhead"
  run call_overhead python3 benchmarks/call_overhead.py --aitk-dir "${AI_TOOLKIT_DIR%%:*}"
  step "benchmark: FLUX.1-shaped, LoRA rank 128, checkpointing, 100% offloaded"
  run flux_bench python3 benchmarks/flux_bench.py --preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --mode all \
    --aitk-dir "${AI_TOOLKIT_DIR%%:*}" --md-out "$OUT/flux_bench.md" --json-out "$OUT/flux_bench.json"
  # Optional (about 4 more minutes): the same under a VRAM cap, layerstream with that cap as its budget.
  if [[ -n "${LAYERSTREAM_BENCH_CAP_GB:-}" ]]; then
    step "benchmark: the same under a ${LAYERSTREAM_BENCH_CAP_GB} GiB VRAM cap, LAYERSTREAM_VRAM_BUDGET=${LAYERSTREAM_BENCH_CAP_GB}GiB"
    run flux_bench_cap env LAYERSTREAM_VRAM_BUDGET="${LAYERSTREAM_BENCH_CAP_GB}GiB" python3 benchmarks/flux_bench.py \
      --preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --mode all --vram-cap-gb "$LAYERSTREAM_BENCH_CAP_GB" \
      --aitk-dir "${AI_TOOLKIT_DIR%%:*}" --md-out "$OUT/flux_bench_cap.md" --json-out "$OUT/flux_bench_cap.json"
  fi
fi

cat "$OUT/summary.txt"
exit $status
