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
# its runtime dependencies first (numpy is the project's own); then the wheel itself, built
# here and reinstalled even if another build is present
pip install "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
# AVX2-level kernels, not -march=native: on the development VM a native build enabled
# AMX (the CPU reports it) and crashed with a segmentation fault at its first evaluation.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON}" \
  pip install --force-reinstall --no-deps --no-cache-dir --no-binary llama-cpp-python \
  "llama-cpp-python==${VERSION}"
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'installed')"
