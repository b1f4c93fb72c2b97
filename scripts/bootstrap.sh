#!/usr/bin/env bash
# Shared set-up for scripts/demo.sh and scripts/test.sh: a virtual environment (.venv, unless one is
# already active), the build tools, and layerstream built and installed from this checkout.
# Source it; it leaves the environment activated.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [[ -n "${VIRTUAL_ENV:-}" && -f "$VIRTUAL_ENV/../toolkit/memory_management/manager.py" ]]; then
  echo "The active venv ($VIRTUAL_ENV) is AI-Toolkit's: these scripts would re-pin its packages to" \
       "requirements-dev.txt. Run 'deactivate' first; to install into AI-Toolkit, see README 'Use it in AI-Toolkit'." >&2
  exit 2
fi
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
  fi
  # shellcheck disable=SC1091
  source .venv/bin/activate
fi
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q -r requirements-dev.txt
# --no-build-isolation: build against the packages of this environment (torch, once the drop-in lands).
python -m pip install -q --no-build-isolation .
