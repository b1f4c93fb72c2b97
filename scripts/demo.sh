#!/usr/bin/env bash
# README command 1: build layerstream and stream a toy model through the engine (GPU if there is one and
# the build has CUDA; otherwise the host-thread simulator with fault injection and the race checker).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
layerstream demo "$@"
