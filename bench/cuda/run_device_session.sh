#!/usr/bin/env bash
# One device call for the CUDA backend (the device tool runs it in a copy of the repository):
#   (FIRST_FILTER) new kernels' tests alone -> GPU tests -> compute-sanitizer memcheck on a short run -> (SERVE=1)
#   the server's curl test on the GPU, with tokens drawn on the host and on the device -> (GEMV=1) dsv4_gemv_bench
#   (GEMV_ARGS, default --quick --pdl; fp4 / fp8 rows also with the copy-engine kernels) -> (GEMM=1) dsv4_gemm_bench
#   (cuBLASLt, the tiled kernel on mma.sync and on wgmma, its nvfp4 lines) -> dsv4 bench (Flash-shaped,
#   NVFP4 + BF16) -> (BENCH_ARGS_B) the bench again with those arguments -> (BENCH_ENV="A=1 B=1") the bench again
#   with those variables set (same arguments), an A/B of switches that are off by default. NO_TESTS=1 skips the
#   test stage (e.g. a second invocation for benchmarks).
# Expects devrun/build.tar.xz made on the CPU machine by bench/cuda/pack_device_build.sh (binaries + the
# non-system shared libraries they need). Test binaries have the source path compiled in: /work/main is linked
# to this copy when it does not exist.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/dsv4
[ -e /work/main ] || { mkdir -p /work && ln -sfn "$PWD" /work/main; }
tar -xJf devrun/build.tar.xz -C /tmp/dsv4
export LD_LIBRARY_PATH="/tmp/dsv4/rt:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
B=/tmp/dsv4/bin
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
# FIRST_FILTER: tests of kernels never run before, in their own process first: a kernel that traps leaves the CUDA
# context unusable, and every later test of the same process would fail with it.
if [ -n "${FIRST_FILTER:-}" ]; then
  T0=$(date +%s)
  timeout ${FIRST_TIMEOUT:-120} "$B/dsv4_cuda_tests" --gtest_filter="$FIRST_FILTER" > "$OUT/tests_first.log" 2>&1
  echo "first tests ($FIRST_FILTER) exit code: $? ($(( $(date +%s) - T0 )) s)"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]|tests ran|^\[cuda-bulk\]" "$OUT/tests_first.log" | head -20
fi
# NO_TESTS=1: no test stage (a second invocation for benchmarks keeps the first one's tests.log).
if [ -z "${NO_TESTS:-}" ]; then
  T0=$(date +%s)
  REST_FILTER=${TEST_FILTER:-${FIRST_FILTER:+-$FIRST_FILTER}}
  timeout ${TEST_TIMEOUT:-240} "$B/dsv4_cuda_tests" ${REST_FILTER:+--gtest_filter=$REST_FILTER} > "$OUT/tests.log" 2>&1
  echo "tests exit code: $? ($(( $(date +%s) - T0 )) s)"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|tests ran" "$OUT/tests.log" | head -30
  grep -E "^\[gemv-grouped\]" "$OUT/tests.log" |
    awk '{ if ($5 > mx) mx = $5; c++ } END { printf "gemv-grouped cases %d, max err/allowed %.3f\n", c, mx }'
  # The model tests' accuracy lines last and few: the summary above must survive the tool's 12,000-character tail.
  grep -E "^\[(cuda-model|cuda-quant|gemm)\]" "$OUT/tests.log" | head -${MODEL_LINES:-12}
fi
if [ -z "${NO_MEMCHECK:-}" ] && command -v compute-sanitizer >/dev/null; then
  T0=$(date +%s)
  timeout 150 compute-sanitizer --tool memcheck --print-limit 5 "$B/dsv4_cuda_tests" \
    --gtest_filter="${MEMCHECK_FILTER:-*GemvGrouped*t1x6*:*GemvGrouped*oneexpert*:GemvRows*:CudaModel.QuantisedNvfp4AllLinears}" \
    > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit code: $? ($(( $(date +%s) - T0 )) s, $(grep -c 'OK \]' "$OUT/memcheck.log") ok, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1))"
fi
if [ -n "${SERVE:-}" ]; then
  for draw in 0 1; do
    T0=$(date +%s)
    DSV4_DEVICE_DRAW=$draw DSV4_SERVE_ARGS="--device cuda" timeout 180 bash tests/server/curl_test.sh "$B/dsv4" models/tiny \
      > "$OUT/serve_draw$draw.log" 2>&1
    echo "serve --device cuda (DSV4_DEVICE_DRAW=$draw) exit code: $? ($(( $(date +%s) - T0 )) s)"
    tail -5 "$OUT/serve_draw$draw.log"
  done
fi
if [ -n "${GEMV:-}" ]; then
  T0=$(date +%s)
  timeout ${GEMV_TIMEOUT:-200} "$B/dsv4_gemv_bench" ${GEMV_ARGS:---quick --pdl} > "$OUT/gemv.log" 2>&1
  echo "gemv bench exit code: $? ($(( $(date +%s) - T0 )) s)"
  grep -E "^(copy|fixed)|mxfp4|nvfp4|fp8_e8m0|fp8_f32s" "$OUT/gemv.log" | head -60
fi
if [ -n "${GEMM:-}" ]; then
  T0=$(date +%s)
  timeout ${GEMM_TIMEOUT:-150} "$B/dsv4_gemm_bench" > "$OUT/gemm.log" 2>&1
  echo "gemm bench exit code: $? ($(( $(date +%s) - T0 )) s)"
  grep -E "^(format|device|nvfp4)" "$OUT/gemm.log" | head -40
fi
if [ -z "${NO_BENCH:-}" ]; then
  T0=$(date +%s)
  timeout ${BENCH_TIMEOUT:-300} "$B/dsv4" bench ${BENCH_ARGS:-} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "bench exit code: $? ($(( $(date +%s) - T0 )) s)"
  cat "$OUT/bench.log" | grep -v "^\s*$" | tail -80
  if [ -n "${BENCH_ARGS_B:-}" ]; then  # a second bench with other arguments (e.g. another --prefill-chunk)
    T0=$(date +%s)
    timeout ${BENCH_TIMEOUT:-300} "$B/dsv4" bench ${BENCH_ARGS_B} --json "$OUT/bench_b.json" > "$OUT/bench_b.log" 2>&1
    echo "bench ($BENCH_ARGS_B) exit code: $? ($(( $(date +%s) - T0 )) s)"
    grep -E "^(decode|prefill|  *[0-9]+ )|switches|info" "$OUT/bench_b.log" | head -40
  fi
  if [ -n "${BENCH_ENV:-}" ]; then
    T0=$(date +%s)
    env $BENCH_ENV timeout ${BENCH_TIMEOUT:-300} "$B/dsv4" bench ${BENCH_ARGS:-} --json "$OUT/bench_env.json" \
      > "$OUT/bench_env.log" 2>&1
    echo "bench with $BENCH_ENV exit code: $? ($(( $(date +%s) - T0 )) s)"
    grep -E "^(decode|prefill|  *[0-9]+ )|copy engine|fused|info" "$OUT/bench_env.log" | head -30
  fi
fi
