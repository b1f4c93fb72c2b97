#!/usr/bin/env bash
# CI stage (issue 48): AI-Toolkit's own run.py on real YAML jobs, stock against layerstream, on the CPU.
# Builds AI-Toolkit's Python environment (scripts/aitk_venv.sh) with a layerstream wheel made from the build
# that scripts/test.sh left (scikit-build-core reuses build/<tag>: no second compile), then runs
# tests/python/test_aitk_jobs.py in it. Run after scripts/test.sh, from the repository root:
#   AI_TOOLKIT_DIR=/path/to/ai-toolkit scripts/ci_aitk_jobs.sh
# Prints "N passed, N failed" last. AITK_JOBS_VENV reuses an environment made earlier (layerstream in it).
# CI_AITK_JOBS_K: pytest -k expression of the jobs to run; by default Z-Image, Wan 2.2 (the video model) and
# FLUX.2, stock vs layerstream, and Ctrl-C inside a step and inside a save, each resumed (within CI's time; ""
# runs every case: Qwen-Image, qfloat8, uint4, two jobs in one process, Ctrl-C between steps too).
set -euo pipefail
cd "$(dirname "$0")/.."
aitk="${AI_TOOLKIT_DIR:-}"
aitk="${aitk%%:*}"
if [ -z "$aitk" ] || [ ! -f "$aitk/run.py" ]; then
  echo "ci_aitk_jobs: skipped: no AI-Toolkit checkout (set AI_TOOLKIT_DIR; it is ${AI_TOOLKIT_DIR:-unset})" >&2
  exit 0
fi
start=$(date +%s)
repo="$PWD"
py="${PYTHON:-$( [ -x .venv/bin/python ] && echo "$repo/.venv/bin/python" || command -v python3 )}"
venv="${AITK_JOBS_VENV:-}"
if [ -z "$venv" ]; then
  # .venv-aitk with AI-Toolkit's packages may be there already (.ci/run makes it while the tests run): this
  # checkout's layerstream goes into it; otherwise it is made here.
  venv="$PWD/.venv-aitk"
  wheels="$(mktemp -d)"
  "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$wheels" .
  if [ -x "$venv/bin/python" ]; then
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$(ls "$wheels"/layerstream-*.whl)"
  else
    scripts/aitk_venv.sh "$venv" "$aitk" "$(ls "$wheels"/layerstream-*.whl)"
  fi
  rm -rf "$wheels"
fi
echo "ci_aitk_jobs: AI-Toolkit environment ready after $(( $(date +%s) - start )) s"
select="${CI_AITK_JOBS_K-zimage or wan22_14b or flux2 or ctrl_c or fails or logging or last_line}"
log="$(mktemp)"
set +e
(cd /tmp && AITK_JOBS_VENV="$venv" AI_TOOLKIT_DIR="$aitk" "$py" -m pytest -q --durations=10 -p no:cacheprovider \
  "$repo/tests/python/test_aitk_jobs.py" "$repo/tests/python/test_logging_disable.py" \
  "$repo/tests/python/test_aitk_runpy_settings.py" ${select:+-k "$select"}) \
  2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
# pytest's closing line ("32 passed, 4 deselected in 364.82s"): its counts, 0 for what it does not name (no
# grep in a pipeline that may find nothing: under pipefail that would end the script before its summary).
summary="$(grep -E ' in [0-9.]+s' "$log" | tail -n 1 || true)"
count() { sed -nE "s/.*[^0-9]([0-9]+) $1.*/\1/p" <<<" $summary" | head -n 1; }
passed="$(count passed)"; failed="$(count failed)"; errors="$(count 'errors?')"; skipped="$(count skipped)"
passed=${passed:-0}; failed=$(( ${failed:-0} + ${errors:-0} )); skipped=${skipped:-0}
rm -f "$log"
echo "ci_aitk_jobs: $(( $(date +%s) - start )) s in all"
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then failed=1; fi
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
