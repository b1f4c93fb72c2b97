#!/usr/bin/env bash
# Creates a Python environment for AI-Toolkit as its users have one, on a machine without a GPU, and installs
# layerstream into it the way README's "Use it in AI-Toolkit" says:
#   scripts/aitk_venv.sh VENV_DIR [AITK_DIR] [WHEEL] [CHECKOUT_DIR]
# AITK_DIR (default: the 27a03a91 snapshot beside this checkout) gives the requirements; its
# requirements_base.txt is installed with these changes, each because the pinned form cannot install or run here:
#   * diffusers: AI-Toolkit pins a git commit (no network but the package index): the released 0.40.0
#     (0.41-0.42 lack a function the LTX-2 extension imports at module level);
#   * transformers 5.10.4 instead of 5.5.3 (the version that works with diffusers 0.40.0);
#   * huggingface_hub unpinned (its pin conflicts with that transformers);
#   * gradio (the old Gradio UI, never imported by run.py) and torchcodec (needs CUDA and FFmpeg libraries)
#     left out; torchaudio has no build for torch 2.13 on the index: tests/aitk_stubs stands in for it.
# About 3.5 minutes with pip's cache warm, 11 on a busy machine with it cold (2 cores).
# torch is the CPU build of 2.13.0, the version AI-Toolkit's README installs; torchvision 0.28.0 is its pair.
# WHEEL: a wheel built for this torch (pip wheel --no-build-isolation --no-deps -w DIR .); without
# it layerstream is built here with LAYERSTREAM_CUDA=OFF (several minutes on two cores); `none`: AI-Toolkit's
# packages only, layerstream installed later (CI makes the environment while its tests run).
# CHECKOUT_DIR: also a writable copy of AI_DIR there, with `layerstream install CHECKOUT_DIR` run in it.
# Jobs need tests/aitk_stubs on PYTHONPATH (its README: torchvision's operators, torchaudio).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:?usage: scripts/aitk_venv.sh VENV_DIR [AITK_DIR] [WHEEL] [CHECKOUT_DIR]}"
aitk="${2:-$here/../shared/ai-toolkit/27a03a91}"
wheel="${3:-}"
checkout="${4:-}"
[ -f "$aitk/requirements_base.txt" ] || { echo "aitk_venv: $aitk has no requirements_base.txt" >&2; exit 2; }

python3 -m venv "$venv"
py="$venv/bin/python"
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
{
  echo "torch==2.13.0"
  echo "torchvision==0.28.0"
  cat "$aitk/requirements_base.txt"
  grep -v '^-r' "$aitk/requirements.txt"
} | sed -e 's/#.*//' -e 's/[[:space:]]*$//' \
      -e 's|^git+https://github.com/huggingface/diffusers.*|diffusers==0.40.0|' \
      -e 's|^transformers==.*|transformers==5.10.4|' \
      -e 's|^huggingface_hub==.*|huggingface_hub|' \
  | grep -v -E '^(gradio|torchcodec)([=<>!~ ]|$)' | grep -v '^$' > "$reqs"
"$py" -m pip install -q -r "$reqs"
if [ "$wheel" = none ]; then
  [ -z "$checkout" ] || { echo "aitk_venv: a CHECKOUT_DIR needs layerstream installed: give a WHEEL" >&2; exit 2; }
elif [ -n "$wheel" ]; then
  "$py" -m pip install -q --no-deps "$wheel"
else
  "$py" -m pip install -q scikit-build-core pybind11 cmake ninja
  LAYERSTREAM_CUDA=OFF "$py" -m pip install -q --no-build-isolation "$here"
fi
if [ -n "$checkout" ]; then
  cp -r "$aitk" "$checkout"
  chmod -R u+w "$checkout"
  (cd "$checkout" && "$venv/bin/layerstream" install "$checkout")
fi
echo "aitk_venv: $venv ready (AI-Toolkit requirements from $aitk)"
