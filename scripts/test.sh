#!/usr/bin/env bash
# README command 2: every test. The C++ core under GoogleTest (ctest), then the Python package under
# pytest. GPU tests run where a GPU is present and are skipped, with the reason, elsewhere.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"

if [[ ! -e /usr/include/gtest/gtest.h && -z "${LAYERSTREAM_GTEST_SOURCE:-}" ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libgtest-dev >/dev/null
  else
    echo "GoogleTest is missing: run 'sudo apt-get install -y libgtest-dev' (Debian/Ubuntu), or set" \
         "LAYERSTREAM_GTEST_SOURCE to a googletest source tree" >&2
    exit 1
  fi
fi

BUILD="${LAYERSTREAM_TEST_BUILD:-build/tests}"
cmake -S . -B "$BUILD" -G Ninja -DLAYERSTREAM_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DLAYERSTREAM_CUDA="${LAYERSTREAM_CUDA:-AUTO}" \
  ${LAYERSTREAM_GTEST_SOURCE:+-DLAYERSTREAM_GTEST_SOURCE="$LAYERSTREAM_GTEST_SOURCE"} ${CMAKE_ARGS:-}
cmake --build "$BUILD"
ctest --test-dir "$BUILD" --output-on-failure -j "$(nproc)"
# From a neutral directory, so that pytest imports the installed package, not the source tree. The
# environment has optimum-quanto and torchao at AI-Toolkit's pins (requirements-dev.txt).
(cd /tmp && python -m pytest -q -rs --durations=10 "$OLDPWD/tests/python")
# The quantized tests again on the libraries' current releases, installed into a folder of their own and put
# in front of the pinned pair (LAYERSTREAM_TEST_CURRENT_QUANT=0 skips this).
if [[ ${LAYERSTREAM_TEST_CURRENT_QUANT:-1} != 0 ]]; then
  CURRENT="$(cd "$BUILD" && pwd)/quant-current"
  python -m pip install -q --no-deps --upgrade --target "$CURRENT" -r requirements-quant-current.txt
  T="$PWD/tests/python"
  (cd /tmp && PYTHONPATH="$CURRENT${PYTHONPATH:+:$PYTHONPATH}" python -m pytest -q -rs \
    "$T/test_quantized.py" "$T/test_quantized_generic.py" \
    "$T/test_aitk_real.py::test_real_quantize_float8_streams_as_stored_and_trains_bitwise")
fi
