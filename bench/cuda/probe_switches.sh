#!/usr/bin/env bash
# Times each set of step switches in its own `dsv4 bench` process (a kernel that faults takes its whole process
# down, and with it every later set of the same run); a set that fails runs again, short, under compute-sanitizer
# memcheck to name the kernel. Run after bench/cuda/run_device_session.sh has unpacked the build (/tmp/dsv4).
#   SETS="mhc routing qnorm" ARGS="--format nvfp4 --prefill 1024 --decode-batch 1,8" bash bench/cuda/probe_switches.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export LD_LIBRARY_PATH="/tmp/dsv4/rt:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
B=/tmp/dsv4/bin
for s in ${SETS:-mhc routing qnorm}; do
  T0=$(date +%s)
  timeout ${SET_TIMEOUT:-90} "$B/dsv4" bench ${ARGS:-} --switches "default,$s" > "$OUT/probe_$s.log" 2>&1
  rc=$?
  echo "switches $s: exit $rc ($(( $(date +%s) - T0 )) s)"
  grep -E "^decode batch|^ +[0-9]+ +[0-9.]+ +[0-9]+|error" "$OUT/probe_$s.log" | head -6
  if [ $rc -ne 0 ] && command -v compute-sanitizer >/dev/null; then
    timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool memcheck --print-limit 3 "$B/dsv4" bench --format nvfp4 \
      --experts 8 --prefill 64 --decode-context 200 --decode-steps 2 --decode-batch 1 --switches "$s" \
      > "$OUT/probe_${s}_memcheck.log" 2>&1
    echo "memcheck ($s): exit $?"
    grep -E "^========= (Invalid|Program hit|Out of)|^=========     at |by thread|Address" "$OUT/probe_${s}_memcheck.log" | head -12
  fi
done
