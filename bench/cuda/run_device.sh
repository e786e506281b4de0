#!/usr/bin/env bash
# One device call: GPU tests, then the GEMV benchmark, then a short summary (the tail the tool returns).
# QUICK=1 skips memcheck, ncu and the SASS dump. Expects a build in ${BUILD:-build-cuda} made on the CPU machine, with its non-system shared libraries in $BUILD/rt.
set -uo pipefail
BUILD=${BUILD:-build-cuda}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BUILD/rt:${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
"$BUILD/tests/cuda/dsv4_cuda_tests" > "$OUT/tests.log" 2>&1
echo "tests exit code: $?"
"$BUILD/bench/cuda/dsv4_gemv_bench" --md "$OUT/gemv_bench.md" > "$OUT/bench.log" 2>&1
echo "bench exit code: $?"
if [ -x "$BUILD/v1/dsv4_gemv_bench" ]; then  # an earlier kernel version carried for A/B, if present
  "$BUILD/v1/dsv4_gemv_bench" > "$OUT/bench_v1.log" 2>&1
  echo "bench v1 exit code: $?"
fi
if [ -z "${QUICK:-}" ] && command -v compute-sanitizer >/dev/null; then
  timeout 90 compute-sanitizer --tool memcheck --print-limit 5 "$BUILD/tests/cuda/dsv4_cuda_tests" \
    --gtest_filter='*m3_n301*auto*:*m64_n45*outf32_auto*:*m1_n34000*:CudaDequant*' > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit code: $? ($(grep -c 'OK \]' "$OUT/memcheck.log") ok, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1))"
fi
if [ -z "${QUICK:-}" ] && command -v ncu >/dev/null; then
  for c in "mxfp4 4096 8192 1" "fp8 32768 1024 1"; do
    timeout 45 ncu --clock-control none --launch-skip 5 --launch-count 1 --section SpeedOfLight \
      --metrics sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,l1tex__throughput.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active \
      "$BUILD/bench/cuda/dsv4_gemv_bench" --one $c > "$OUT/ncu_${c// /_}.log" 2>&1
  done
fi
[ -z "${QUICK:-}" ] && command -v cuobjdump >/dev/null && cuobjdump -sass "$BUILD/bench/cuda/dsv4_gemv_bench" > "$OUT/gemv.sass" 2>&1
echo "=== tests"
grep -E "^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]|tests ran" "$OUT/tests.log" | head -20
grep "^\[device\]" "$OUT/tests.log"
for f in bf16 fp8_block_e8m0 fp8_block_f32scale mxfp4 nvfp4; do
  for o in outf32 outbf16; do
    grep "^\[gemv\] ${f}_m" "$OUT/tests.log" | grep "_${o}_" | awk -v n="$f $o" '{ if ($4 > mx) mx = $4; if ($7 > mr) mr = $7; c++ }
      END { printf "%-28s cases %3d  max normwise %.2e  max err/allowed %.3f\n", n, c, mx, mr }'
  done
done
for f in "$OUT"/ncu_*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -E "DRAM Throughput|Duration|pct_of_peak|Memory Throughput" "$f" | sed -E 's/ +/ /g'; }; done
if [ -f "$OUT/bench_v1.log" ]; then echo "=== bench v1 (previous kernel build: us/step, GB/s)"; grep -E "^(bf16|fp8|mxfp4|nvfp4)" "$OUT/bench_v1.log" | awk '{print $1, $2, $3, $4, $(NF-5), $(NF-4)}'; fi
echo "=== bench"
cat "$OUT/bench.log"
