#!/usr/bin/env bash
# Optional peer engines for the benchmarks; CI never runs this. Builds llama.cpp through
# llama-cpp-python from source for this CPU (needs a C++ compiler and cmake; about 12
# minutes on 2 cores) into the active Python environment. Afterwards
#   python tools/bench_decode.py --batch_sizes=1 --contexts=256
# prints llama.cpp's batch-1 decode step beside jaxinfer's and HF's, and
#   python -m experiments.batch_sweep
# adds llama.cpp's throughput at batch 1.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  echo "activate the project's virtual environment first (. .venv/bin/activate)" >&2
  exit 2
fi
# GGML_NATIVE: compile for this machine's instruction set (AVX2 / AVX-512 where present).
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
  pip install --no-binary llama-cpp-python "llama-cpp-python==${VERSION}"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
