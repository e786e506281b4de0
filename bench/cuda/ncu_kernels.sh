#!/usr/bin/env bash
# Stall reasons and instruction mix of chosen kernels inside graph-replayed decode steps (device tool, after
# run_device_session.sh or a plain unpack of devrun/build.tar.xz into /tmp/dsv4):
#   KERNELS   ncu kernel-name regex (default: the indexer select, the cluster collapse, the fp4 GEMVs)
#   SKIP      matching launches skipped first (prefill and warm-up), COUNT profiled after them
#   BATCH     decode batch (default 1); SASS=1 also dumps the SASS of those kernels from the CUDA library.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="/tmp/dsv4/rt:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
KERNELS=${KERNELS:-indexer_select|hc_collapse_cluster|gemv_kernel}
T0=$(date +%s)
timeout ${NCU_TIMEOUT:-300} ncu --clock-control none -k "regex:$KERNELS" --launch-skip ${SKIP:-3000} \
  --launch-count ${COUNT:-60} --section SpeedOfLight --section WarpStateStats --section InstructionStats \
  --section SchedulerStats --section Occupancy --section LaunchStats --csv --page details \
  --log-file "$OUT/ncu_sections.csv" /tmp/dsv4/bin/dsv4 bench --format nvfp4 --prefill 256 \
  --decode-batch ${BATCH:-1} --decode-steps 40 > "$OUT/ncu_bench.log" 2>&1
echo "ncu exit code: $? ($(( $(date +%s) - T0 )) s)"
if [ -n "${SASS:-}" ]; then  # the kernels are linked statically into the binary: keep only the matching functions
  cuobjdump -sass /tmp/dsv4/bin/dsv4 > /tmp/all.sass 2>&1
  awk -v pat="${SASS_FUNCS:-gemv_kernelILNS0_3FmtE4ELi1E|indexer_select}" \
    '/Function :/ { keep = ($0 ~ pat) } keep' /tmp/all.sass > "$OUT/sass.txt"
  echo "sass: $(grep -c 'Function :' "$OUT/sass.txt") functions, $(wc -l < "$OUT/sass.txt") lines"
fi
