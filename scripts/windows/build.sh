#!/usr/bin/env bash
# Cross-builds layerstream's Windows x64 extension modules on Linux: layerstream._native and manager_modules
# (.pyd, MSVC ABI, CPython 3.12, torch 2.13.0 CPU) with clang-cl and lld-link against the pinned sysroot of
# scripts/windows/sysroot.sh. Output: build/windows/package/layerstream (the Python package with both .pyd).
#
#   scripts/windows/build.sh            configure if needed, build, assemble the package
#   LSWIN_JOBS=2              parallel compile jobs (default 2)
#
# Needs: clang-19, lld-19, llvm-19 (Debian), cmake >= 3.24, ninja, python3 with pip, CPython 3.12's headers.
# A CI check of the MSVC ABI, not a release build: see docs/install.md.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
SYSROOT="$("$REPO/scripts/windows/sysroot.sh")"
BUILD="$REPO/build/windows"
JOBS="${LSWIN_JOBS:-2}"
TORCH_VERSION="$(tr -d '\r' < "$SYSROOT/torch/version.py" | sed -n "s/^__version__ = '\(.*\)'$/\1/p")"
[[ -n $TORCH_VERSION ]] || { echo "cannot read the torch version from $SYSROOT/torch/version.py" >&2; exit 1; }

export LSWIN_SYSROOT="$SYSROOT"
if [[ ! -f "$BUILD/cmake/build.ninja" ]]; then
  cmake -S "$REPO" -B "$BUILD/cmake" -G Ninja \
    -DCMAKE_TOOLCHAIN_FILE="$REPO/cmake/windows-clang-cl.cmake" \
    -DLAYERSTREAM_WIN_SYSROOT="$SYSROOT" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLAYERSTREAM_BUILD_PYTHON=ON -DLAYERSTREAM_CUDA=OFF -DLAYERSTREAM_TORCH=ON \
    -DPython_INCLUDE_DIR="$SYSROOT/python/include" \
    -DPython_LIBRARY="$SYSROOT/python/libs/python312.lib" \
    -DPYTHON_MODULE_EXTENSION=.cp312-win_amd64.pyd \
    -DPYTHON_IS_DEBUG=OFF -DPYTHON_MODULE_DEBUG_POSTFIX= -DPYBIND11_USE_CROSSCOMPILING=ON \
    -Dpybind11_DIR="$SYSROOT/pybind11/share/cmake/pybind11" \
    -DLAYERSTREAM_TORCH_PREFIX="$SYSROOT/torch/share/cmake" \
    -DLAYERSTREAM_TORCH_VERSION="$TORCH_VERSION" \
    -DCMAKE_INSTALL_PREFIX="$BUILD/package" >&2
fi
cmake --build "$BUILD/cmake" -j "$JOBS" >&2
rm -rf "$BUILD/package"
cmake --install "$BUILD/cmake" >&2
cp -r "$REPO/python/layerstream/." "$BUILD/package/layerstream/"
find "$BUILD/package" -name __pycache__ -prune -exec rm -rf {} +
rm -f "$BUILD/package/layerstream/"*.in
# What an installed wheel carries for importlib.metadata (layerstream.__version__, the console script).
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$REPO/pyproject.toml")"
mkdir -p "$BUILD/package/layerstream-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: layerstream\nVersion: %s\n' "$VERSION" > "$BUILD/package/layerstream-$VERSION.dist-info/METADATA"
printf '[console_scripts]\nlayerstream = layerstream.cli:main\n' > "$BUILD/package/layerstream-$VERSION.dist-info/entry_points.txt"
echo "$BUILD/package"
