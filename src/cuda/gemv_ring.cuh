// SPDX-License-Identifier: MIT
// A warp's ring of shared-memory stages fed by the copy engine, for the skinny kernels that stream their weights
// that way (gemv_bulk.cu: bf16 mma on fp4 / fp8 weights; gemv_w4a8.cu: fp8 mma on fp4 weights). A stage holds the
// warp's 16-row tile x 256 weight bytes, and the rows' scale bytes for fp4 formats; lane r < 16 copies row r, lane
// 16 + r that row's scales, each with one cp.async.bulk completing on the stage's mbarrier (bulk_copy.cuh).
// Stage layout (bytes): even rows 2j at 256 j, odd rows 2j + 1 at 2112 + 256 j, so the rows g and g + 1 that one
// quarter warp reads together are 64 bytes apart mod 128 (different bank halves), then row r's scale bytes at
// 4160 + 32 r (NVFP4: 32 e4m3 bytes; MXFP4: 16 e8m0 bytes).
// Weights in the tile layout (weight_tiles.h; fp4 only): a stage of a tile is 4096 contiguous bytes of it and 16 x
// (32 or 16) contiguous scale bytes, so lane 0 copies the weights and lane 1 the scales, each with one copy, into the
// same layout: chunk c of the stage at 1024 c (rows 0-7 first, lane l's piece at 16 l, rows 8-15 at 512 + 16 l), its
// scales at 4160 + c · 16 · 4 · piece (rows 0-7, then 8-15 at + 8 · 4 · piece). A warp's reads of a chunk are then
// 512 contiguous bytes (no bank conflicts without the odd-row offset).
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/bulk_copy.cuh"
#include "cuda/gemv_launch.h"

namespace dsv4::detail {

constexpr int kStageChunks = 4;                               // 64-byte chunks of a row per stage
constexpr int kStageRowBytes = kStageChunks * 64;             // 256
constexpr int kOddRowsAt = 8 * kStageRowBytes + 64;           // 2112
constexpr int kScalesAt = 16 * kStageRowBytes + 64;           // 4160
constexpr int kScaleRowBytes = 32;
constexpr int kStageBytes = kScalesAt + 16 * kScaleRowBytes;  // 4672
static_assert(kStageBytes % 16 == 0, "copy alignment");

__device__ __forceinline__ int stage_row_at(int r) {
  return r & 1 ? kOddRowsAt + (r >> 1) * kStageRowBytes : (r >> 1) * kStageRowBytes;
}

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// The 16-row tile that this warp streams and its share of the tile's n_stages stages, organised like the register
// kernel: a.split warps per tile, kGemvWarps / a.split tiles per block. A tile past n has rows_valid <= 0 and no
// stages.
struct WarpTile {
  int tiles_per_block, row0, rows_valid;
  int s_begin, stages;  // stages [s_begin, s_begin + stages) of every row of the tile
};
__device__ __forceinline__ WarpTile warp_tile(const KernelArgs& a, int n_stages) {
  const int warp = threadIdx.x >> 5, split = a.split, part = warp % split;
  WarpTile w;
  w.tiles_per_block = kGemvWarps / split;
  w.row0 = (blockIdx.x * w.tiles_per_block + warp / split) * 16;
  w.rows_valid = min(16, a.n - w.row0);
  w.s_begin = part * n_stages / split;
  w.stages = w.rows_valid > 0 ? (part + 1) * n_stages / split - w.s_begin : 0;
  return w;
}

// Stages s_begin, s_begin + 1, .. of the tile (stage s = weight bytes [256 s, 256 s + 256) of each row, scale bytes
// [scale_bytes · s, ..) of each scale row). q counts every stage the warp has used (over all row passes), so slot
// q % kStages has completed q / kStages phases before stage q.
template <int kStages>
struct WarpRing {
  uint8_t* ring;            // kStages * kStageBytes, 16-byte aligned
  uint64_t* bar;            // kStages mbarriers
  const uint8_t* w_tile;    // the tile's row 0
  const uint8_t* s_tile;    // its scale row 0 (unused when scale_bytes is 0)
  size_t row_bytes, scale_ld;
  int rows_valid, s_begin, scale_bytes;
  bool tiles;               // w_tile / s_tile in the tile layout (then rows_valid is 16)

  static constexpr int kBytes = kStages * kStageBytes;

  __device__ void init(int lane) const {
    if (lane < kStages) barrier_init(bar + lane);
    barrier_init_fence();
    __syncwarp();
  }
  // Every lane of the warp calls it (after its reads of the slot's previous stage).
  __device__ void issue(int i, int q, int lane) const {
    uint8_t* stage = ring + (q % kStages) * kStageBytes;
    uint64_t* b = bar + q % kStages;
    fence_proxy_async();  // this lane's reads of the slot come before the copy engine's writes
    if (lane == 0) expect_bytes(b, uint32_t(rows_valid) * uint32_t(kStageRowBytes + scale_bytes));
    __syncwarp();
    const int r = lane & 15, s = s_begin + i;
    if (tiles) {
      if (lane == 0) bulk_copy(stage, w_tile + size_t(s) * 16 * kStageRowBytes, 16 * kStageRowBytes, b);
      if (lane == 1 && scale_bytes > 0)
        bulk_copy(stage + kScalesAt, s_tile + size_t(s) * 16 * scale_bytes, 16 * uint32_t(scale_bytes), b);
      return;
    }
    if (r >= rows_valid) return;
    if (lane < 16)
      bulk_copy(stage + stage_row_at(r), w_tile + size_t(r) * row_bytes + size_t(s) * kStageRowBytes, kStageRowBytes,
                b);
    else if (scale_bytes > 0)
      bulk_copy(stage + kScalesAt + r * kScaleRowBytes, s_tile + size_t(r) * scale_ld + size_t(s) * scale_bytes,
                uint32_t(scale_bytes), b);
  }
  // The first stages of a pass over the warp's `count` stages: up to kStages of them, the first being q0.
  __device__ void start(int q0, int count, int lane) const {
    for (int i = 0; i < count && i < kStages; ++i) issue(i, q0 + i, lane);
  }
  __device__ const uint8_t* wait(int q) const {
    wait_phase(bar + q % kStages, uint32_t(q / kStages) & 1u);
    return ring + (q % kStages) * kStageBytes;
  }
};

}  // namespace dsv4::detail
