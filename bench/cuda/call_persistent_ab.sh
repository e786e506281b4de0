#!/usr/bin/env bash
# One device call for the walking (persistent) wgmma kernel, written in stops 41-42 and not yet run on a GPU:
# its tests first in their own process, the prefill A/B (dsv4 bench --switches persist,nopersist twice), the gemm
# bench with DSV4_GEMV_WGMMA_PERSISTENT=1 / 0, then the rest of the GPU suite with the walking kernel on and memcheck
# on the walk cases; the logs come back as logs.tgz. Needs devrun/build.tar.xz (bench/cuda/pack_device_build.sh):
# run `bash bench/cuda/call_persistent_ab.sh` with carry ["devrun"].
set -uo pipefail
OUT=${OUT:-/tmp/out}
export DSV4_GEMV_WGMMA_PERSISTENT=1
NEW_TESTS='GemvWgmma.*:GemvTiles.*:GemvBatched*:*GemvGrouped*wgmma*:CudaModel.SwigluInWgmmaTilesChangesNoBits'
AB='--switches persist,nopersist,persist,nopersist --profile-prefill 8192'
FIRST_FILTER=$NEW_TESTS NO_TESTS=1 NO_MEMCHECK=1 BENCH_TIMEOUT=220 \
BENCH_ARGS="--format nvfp4 --prefill 8192,32768 --decode-batch 1 --decode-steps 8 $AB" \
  bash bench/cuda/run_device_session.sh
B=/tmp/dsv4/bin
for v in 1 0; do
  T0=$(date +%s)
  DSV4_GEMV_WGMMA_PERSISTENT=$v timeout 70 "$B/dsv4_gemm_bench" > "$OUT/gemm_p$v.log" 2>&1
  echo "gemm bench persistent=$v exit $? ($(( $(date +%s) - T0 )) s)"
  grep -vE "^\s*$" "$OUT/gemm_p$v.log" | cut -c1-230 | head -16
done
WALK_CASES='*GemvGrouped*walk*:*GemvGrouped*pertile*:GemvWgmma.BlockShapesAgreeBitForBit'
TEST_TIMEOUT=170 NO_BENCH=1 MEMCHECK_FILTER=$WALK_CASES \
  TEST_FILTER="-$NEW_TESTS" FIRST_FILTER= bash bench/cuda/run_device_session.sh
cd "$OUT" && tar czf logs.tgz *.log *.json 2>/dev/null && rm -f *.log *.json
