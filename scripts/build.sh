#!/usr/bin/env bash
# Configures and builds dsv4 into ./build (CUDA backend included when nvcc is present).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null; then export PATH=/usr/local/cuda/bin:$PATH; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j"$(nproc)"
