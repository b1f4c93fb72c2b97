#!/usr/bin/env bash
# CI's Windows stage: cross-builds the Windows .pyd modules from Linux (scripts/windows/build.sh) and runs the
# simulator-backed Python tests under Wine with Windows CPython 3.12 and torch 2.13.0+cpu
# (scripts/windows/test_wine.sh), then shows that an old VC++ runtime (Wine's built-in msvcp140.dll) is
# refused with the fix instead of crashing. Downloads are pinned and cached outside the repository
# ($LSWIN_CACHE, default ~/.cache/layerstream-win).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
export DEBIAN_FRONTEND=noninteractive
if ! command -v /usr/lib/llvm-19/bin/clang >/dev/null || [[ ! -x /usr/lib/wine/wine64 ]]; then
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends clang-19 lld-19 llvm-19 wine64 cmake ninja-build unzip >/dev/null
fi
scripts/windows/build.sh >/dev/null
echo "windows stage: cross-build done after $((SECONDS - start)) s"
set +e
scripts/windows/test_wine.sh
rc=$?
set -e
echo "windows stage: $((SECONDS - start)) s in all"
exit "$rc"
