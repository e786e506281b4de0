#!/usr/bin/env bash
# Runs the whole test suite (builds first).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
