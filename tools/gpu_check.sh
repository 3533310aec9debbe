#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU (jax with the CUDA plugin already
# installed; installs nothing). Checks every kernel variant against its reference and
# times it against the memory-bandwidth floor; the table comes last. Under 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_JSON="${OUT:-.}/gpu_check.json"
timeout 290 python3 tools/gpu_check.py
