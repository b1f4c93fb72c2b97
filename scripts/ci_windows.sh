#!/usr/bin/env bash
# CI's Windows stage: cross-builds the Windows .pyd modules from Linux (scripts/windows/build.sh) and runs the
# simulator-backed Python tests under Wine with Windows CPython 3.12 and torch 2.13.0+cpu
# (scripts/windows/test_wine.sh), then shows that old VC++ runtimes (Wine's built-in msvcp140.dll and
# vcruntime140.dll) are refused with the fix instead of crashing. Downloads are pinned and cached outside the repository
# ($LSWIN_CACHE, default ~/.cache/layerstream-win).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
if ! command -v /usr/lib/llvm-19/bin/clang >/dev/null || [[ ! -x /usr/lib/wine/wine64 ]]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends clang-19 lld-19 llvm-19 wine64 cmake ninja-build unzip >/dev/null
fi
build_log="$(mktemp)"
if ! scripts/windows/build.sh >"$build_log" 2>&1; then
  tail -40 "$build_log"; echo "windows stage: the cross-build failed"; echo "0 passed, 1 failed"; exit 1
fi
rm -f "$build_log"
echo "windows stage: cross-build done after $((SECONDS - start)) s"
set +e
scripts/windows/test_wine.sh
rc=$?
set -e
# Old VC++ runtimes (Wine's own DLLs stand for them: its msvcp140.dll, then its vcruntime140.dll) are refused
# at import with the fix, not met with a crash or wrong gradients.
for old in "msvcp140,msvcp140_1,msvcp140_2,msvcp140_atomic_wait,msvcp140_codecvt_ids=b;vcruntime140,vcruntime140_1=n,b" \
           "msvcp140,msvcp140_1,msvcp140_2,msvcp140_atomic_wait,msvcp140_codecvt_ids=n,b;vcruntime140,vcruntime140_1=b"; do
  dll="${old%%,*}.dll"; [[ $old == *"vcruntime140,vcruntime140_1=b" ]] && dll=vcruntime140.dll
  set +e
  out="$(LSWIN_WINE_DLLS="$old" scripts/windows/test_wine.sh --python -c "import layerstream" 2>&1)"
  old_rc=$?
  set -e
  if [[ $old_rc == 1 ]] && grep -q "^ImportError: layerstream needs the Microsoft Visual C++ Redistributable 14.40 or newer, but this process loaded $dll .*vc_redist.x64.exe" <<<"$out"; then
    echo "windows stage: Wine's own $dll is refused with the fix: 1 passed, 0 failed"
  else
    echo "$out" | tail -5
    echo "windows stage: Wine's own $dll was not refused as it should be (exit $old_rc): 0 passed, 1 failed"
    rc=1
  fi
done
echo "windows stage: $((SECONDS - start)) s in all"
exit "$rc"
