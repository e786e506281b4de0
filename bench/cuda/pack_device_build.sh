#!/usr/bin/env bash
# Packs a CPU-machine build for bench/cuda/run_device_session.sh: the dsv4 binary, the CUDA test binary and the
# shared libraries the device machine lacks, xz-compressed under devrun/ (ignored by git, carried by the tool).
set -euo pipefail
BUILD=${1:-build}
rm -rf devrun/stage && mkdir -p devrun/stage/bin devrun/stage/rt
cp "$BUILD/src/dsv4" "$BUILD/tests/cuda/dsv4_cuda_tests" devrun/stage/bin/
# BENCHES: the bench binaries to take (all three with the tracked tree exceed the device tool's 64 MiB carry).
for b in ${BENCHES:-dsv4_gemm_bench}; do [ -x "$BUILD/bench/cuda/$b" ] && cp "$BUILD/bench/cuda/$b" devrun/stage/bin/; done
for lib in $(ldd devrun/stage/bin/* | awk '/=> \// {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libstdc++.so*|libgcc_s.so*|libcublas*) ;;
    *) cp -L "$lib" devrun/stage/rt/ ;;
  esac
done
tar -cJf devrun/build.tar.xz -C devrun/stage bin rt
rm -rf devrun/stage
ls -la devrun/build.tar.xz
