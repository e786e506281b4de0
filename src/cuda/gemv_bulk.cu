// SPDX-License-Identifier: MIT
// The skinny kernel of gemv.cu with its weight stream on the copy engine (FP4 and FP8 weights, m <= 64; k a
// multiple of one stage: 512 for FP4, 256 for FP8; gemv_bulk_supported). Same tiles, same split of a tile's k over
// `split` warps, same decode and mma (gemv_piece.cuh); only the way weight bytes arrive differs.
//
// Why: the register kernel holds at most 128 bytes per thread in flight and waits for them before it decodes, and
// an fp4 byte costs ~6 instructions of decode and mma, so its warps alternate between waiting and decoding and the
// fp4 GEMVs stream at ~0.5 of copy bandwidth, fp8 at ~0.6 (docs/perf.md). Here each warp owns a ring of kStages
// shared-memory stages of 16 rows x 256 bytes: lane r < 16 copies row r's bytes, lane 16 + r that row's FP4 scale
// bytes, with cp.async.bulk completing on the stage's mbarrier. Copies hold no registers and cost one instruction
// per row, the ring keeps kStages - 1 stages in flight while the warp decodes one, and a plain launch issues its
// first stages before griddepcontrol.wait (weights never depend on the previous kernel), so they overlap its tail.
// FP8 block scales (one per 128 rows x 128 k, uniform over a tile) come through the read-only cache, a stage ahead.
// (bench/cuda/gemv_stream_proto.cu, a block-level version with one producer warp and whole-tile stages shared by a
// block, measured slower than the register kernel: docs/perf.md, fifth round. Here the stages are per warp, small
// and many, and no block barrier runs before the final split-k sum.)
// The ring and its stage layout: gemv_ring.cuh. FP4 weights in the tile layout (weight_tiles.h, the engine's
// default) come as one weight copy and one scale copy per stage instead of 16 row copies and 16 scale copies.
// Grouped launches with settled slots (KernelArgs::slots_settled) read their slot and issue their first stages before
// waiting, like the register kernel.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemv_launch.h"
#include "cuda/gemv_piece.cuh"
#include "cuda/gemv_ring.cuh"
#include "cuda/gemv_slot.cuh"
#include "cuda/launch.cuh"

namespace dsv4::detail {
namespace {

constexpr int kThreads = kGemvWarps * 32;
template <Fmt F>
constexpr int stage_k() { return kStageChunks * 4 * elems_per_16b<F>(); }  // weights of a row per stage
template <Fmt F>
constexpr int stage_scale_bytes() { return F == Fmt::NVFP4 ? 32 : F == Fmt::MXFP4 ? 16 : 0; }  // per row
constexpr int kStages = 3;
using Ring = WarpRing<kStages>;
constexpr int kRingBytes = kGemvWarps * Ring::kBytes;
constexpr int kSmemBytes = kRingBytes + kGemvWarps * kStages * int(sizeof(uint64_t));
static_assert(kRingBytes % 16 == 0, "copy alignment");
static_assert(kGemvWarps * 16 * (8 * 8 + 1) * 4 <= kRingBytes, "the split-k sums reuse the ring");

// This lane's raw pieces of rows g and g + 8 (g = lane / 4) in chunk c of a stage and their scale bits (FP8: the
// chunk's block scale fp8_block, the same for every row of the tile); zeros for rows past n (row-major only: a tiled
// matrix has whole tiles).
struct StagePieces {
  uint4 lo, hi;
  uint32_t sc_lo, sc_hi;
};
template <Fmt F, bool kTileLayout>
__device__ __forceinline__ StagePieces stage_pieces(const uint8_t* stage, int c, int lane, bool ok_lo, bool ok_hi,
                                                    uint32_t fp8_block) {
  StagePieces p{};
  if constexpr (kTileLayout) {  // the lane's pieces of the chunk's two halves (gemv_ring.cuh)
    constexpr int kPiece = F == Fmt::NVFP4 ? 2 : 1, kScaleChunk = 16 * 4 * kPiece;
    p.lo = lds128(stage + c * 16 * kChunkBytes + lane * 16);
    p.hi = lds128(stage + c * 16 * kChunkBytes + 8 * kChunkBytes + lane * 16);
    const uint8_t* sc = stage + kScalesAt + c * kScaleChunk + lane * kPiece;
    if constexpr (F == Fmt::NVFP4) {  // the piece's two e4m3 scales, low byte first
      p.sc_lo = *reinterpret_cast<const uint16_t*>(sc);
      p.sc_hi = *reinterpret_cast<const uint16_t*>(sc + kScaleChunk / 2);
    } else {
      p.sc_lo = sc[0], p.sc_hi = sc[kScaleChunk / 2];
    }
    return p;
  }
  const int g = lane >> 2, t = lane & 3;
  if (ok_lo) p.lo = lds128(stage + stage_row_at(g) + c * kChunkBytes + t * 16);
  if (ok_hi) p.hi = lds128(stage + stage_row_at(g + 8) + c * kChunkBytes + t * 16);
  const uint8_t* sc = stage + kScalesAt + g * kScaleRowBytes;
  if constexpr (F == Fmt::NVFP4) {  // the piece's two e4m3 scales, low byte first
    if (ok_lo) p.sc_lo = *reinterpret_cast<const uint16_t*>(sc + c * 8 + t * 2);
    if (ok_hi) p.sc_hi = *reinterpret_cast<const uint16_t*>(sc + 8 * kScaleRowBytes + c * 8 + t * 2);
  } else if constexpr (F == Fmt::MXFP4) {  // the piece's e8m0 byte
    if (ok_lo) p.sc_lo = sc[c * 4 + t];
    if (ok_hi) p.sc_hi = sc[8 * kScaleRowBytes + c * 4 + t];
  } else {
    p.sc_lo = p.sc_hi = fp8_block;
  }
  return p;
}

template <Fmt F, int kTilesN, bool kGrouped, bool kTileLayout = false>
__global__ void __launch_bounds__(kThreads, kTilesN <= 2 ? 2 : 1) gemv_bulk_kernel(const KernelArgs a) {
  static_assert(F != Fmt::BF16, "bf16 weights stream at copy bandwidth through the register kernel");
  static_assert(!kTileLayout || F == Fmt::MXFP4 || F == Fmt::NVFP4, "the tile layout is for fp4 weights");
  gpu::allow_dependents();
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr bool kFp8 = F == Fmt::FP8_E8M0 || F == Fmt::FP8_F32;
  constexpr int kElems = elems_per_16b<F>();  // weights per 16-byte piece
  constexpr int kChunkK = 4 * kElems, kStageK = stage_k<F>();
  constexpr int kPairs = kElems / 2;          // bf16x2 words per decoded piece
  constexpr int kScaleBytes = stage_scale_bytes<F>();  // a row's FP4 scale bytes per stage

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const WarpTile wt = warp_tile(a, a.k / kStageK);
  const int s_begin = wt.s_begin, my_stages = wt.stages;
  const bool ok_lo = g < wt.rows_valid, ok_hi = g + 8 < wt.rows_valid;
  const size_t row_bytes = kFp8 ? size_t(a.k) : size_t(a.k) / 2;
  const size_t scale_ld = kFp8 ? size_t(a.k + 127) / 128 : size_t(a.k) / (F == Fmt::NVFP4 ? 16 : 32);

  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kRingBytes) + warp * kStages;

  const bool grouped_early = kGrouped && a.slots_settled;
  BlockRows rows;
  if (!block_rows<kGrouped>(a, rows, !grouped_early)) return;  // an empty slot: the whole block, before any barrier
  const int tile_row = rows.w_row0 + wt.row0;  // the tile's first row in the weight matrix
  const uint8_t* w_tile = rows.w + size_t(tile_row) * row_bytes;
  // FP4: the tile's first scale row; FP8: the scale row of its 128-row block (a tile lies in one: w_row0 % 16 == 0).
  const uint8_t* s_tile = rows.w_scale + (kFp8 ? size_t(tile_row / 128) * scale_ld * (F == Fmt::FP8_F32 ? 4 : 1)
                                               : size_t(tile_row) * scale_ld);
  // FP8: the raw scale (e8m0 byte or f32 bits) of 128-block kb of the tile's k.
  auto fp8_scale = [&](int kb) -> uint32_t {
    if constexpr (F == Fmt::FP8_E8M0) return __ldg(s_tile + kb);
    else return __ldg(reinterpret_cast<const uint32_t*>(s_tile) + kb);
  };

  const Ring ring{smem + warp * Ring::kBytes, bars, w_tile, s_tile, row_bytes, scale_ld, wt.rows_valid, s_begin,
                  kScaleBytes, kTileLayout};
  ring.init(lane);

  int q0 = 0;  // stages this warp has consumed in earlier row passes
  if (!kGrouped || grouped_early) {
    ring.start(0, my_stages, lane);
    gpu::dependent_wait();  // x and y belong to the step
  }

  for (int rb = 0; rb < rows.m_rows; rb += kTilesN * 8) {
    if (rb > 0) {
      __syncthreads();  // the previous pass's reads of the split-k sums (which reuse the ring) are done
      ring.start(q0, my_stages, lane);
    } else if (kGrouped && !grouped_early) {
      ring.start(0, my_stages, lane);
    }
    const __nv_bfloat16* x_row[kTilesN];  // this thread's batch row of each n-tile, nullptr past the slot's rows
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) {
      const int row = rb + j * 8 + g;
      x_row[j] = row < rows.m_rows
                     ? rows.x + size_t(kGrouped ? a.row_order[rows.order0 + row] / a.x_row_div : row) * a.k
                     : nullptr;
    }
    float acc[kTilesN][4];
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    // FP8: the two block scales of the stage being decoded and of the next one (loaded a stage ahead).
    uint32_t fp8_now[2] = {0, 0}, fp8_next[2] = {0, 0};
    if constexpr (kFp8) {
      if (my_stages > 0) fp8_next[0] = fp8_scale(2 * s_begin), fp8_next[1] = fp8_scale(2 * s_begin + 1);
    }
    for (int i = 0; i < my_stages; ++i) {
      const int q = q0 + i;
      if constexpr (kFp8) {
        fp8_now[0] = fp8_next[0], fp8_now[1] = fp8_next[1];
        if (i + 1 < my_stages) {
          const int kb = 2 * (s_begin + i + 1);
          fp8_next[0] = fp8_scale(kb), fp8_next[1] = fp8_scale(kb + 1);
        }
      }
      const uint8_t* stage = ring.wait(q);
#pragma unroll
      for (int c = 0; c < kStageChunks; ++c) {
        const StagePieces pc = stage_pieces<F, kTileLayout>(stage, c, lane, ok_lo, ok_hi, fp8_now[c / 2]);
        uint32_t w_lo_bf[kPairs], w_hi_bf[kPairs];
        decode_piece<F>(pc.lo, pc.sc_lo, w_lo_bf);
        decode_piece<F>(pc.hi, pc.sc_hi, w_hi_bf);
        const int kk = (s_begin + i) * kStageK + c * kChunkK + t * kElems;
        mma_chunk<F, kTilesN>(acc, w_lo_bf, w_hi_bf, x_row, kk, true, pc.sc_lo);
      }
      __syncwarp();  // every lane's reads of this slot are done before it is refilled
      if (i + kStages < my_stages) ring.issue(i + kStages, q + kStages, lane);
    }
    q0 += my_stages;

    __syncthreads();  // every warp has left its ring (no copy in flight) before the sums reuse it
    store_tile_sums<kTilesN, kGrouped>(a, rows, wt.tiles_per_block, a.split, rb, acc, reinterpret_cast<float*>(smem));
  }
}

template <auto kKernel>
cudaError_t launch_kernel(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  if (const cudaError_t e = gpu::allow_dynamic_smem<kKernel>(kSmemBytes); e != cudaSuccess) return e;
  gpu::launch(kKernel, grid, kThreads, kSmemBytes, stream, a);
  return cudaGetLastError();
}

template <Fmt F, bool kGrouped, bool kTileLayout>
cudaError_t launch_for_m(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  if (a.m <= 8) return launch_kernel<gemv_bulk_kernel<F, 1, kGrouped, kTileLayout>>(a, grid, stream);
  if (a.m <= 16) return launch_kernel<gemv_bulk_kernel<F, 2, kGrouped, kTileLayout>>(a, grid, stream);
  if (a.m <= 32) return launch_kernel<gemv_bulk_kernel<F, 4, kGrouped, kTileLayout>>(a, grid, stream);
  return launch_kernel<gemv_bulk_kernel<F, 8, kGrouped, kTileLayout>>(a, grid, stream);
}

template <Fmt F, bool kGrouped>
cudaError_t launch_fmt(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  const int rows_per_block = kGemvWarps / a.split * 16;
  grid.x = (a.n + rows_per_block - 1) / rows_per_block;
  if constexpr (F == Fmt::MXFP4 || F == Fmt::NVFP4)
    if (a.tiles) return launch_for_m<F, kGrouped, true>(a, grid, stream);
  if (a.tiles) return cudaErrorInvalidValue;  // bulk_shape_ok refuses the tile layout for fp8
  return launch_for_m<F, kGrouped, false>(a, grid, stream);
}

template <Fmt F>
cudaError_t launch_any(const KernelArgs& a, dim3 grid, cudaStream_t stream, bool grouped) {
  return grouped ? launch_fmt<F, true>(a, grid, stream) : launch_fmt<F, false>(a, grid, stream);
}

}  // namespace

namespace {
bool bulk_shape_ok(const GemvParams& p) {
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool fp4 = p.weight == GemvWeight::MXFP4 || p.weight == GemvWeight::NVFP4;
  const int stage = fp4 ? stage_k<Fmt::NVFP4>() : stage_k<Fmt::FP8_E8M0>();
  return (fp4 || p.weight == GemvWeight::FP8_BLOCK) && (p.layout == GemvLayout::Rows || fp4) && p.m <= kGemvMaxM &&
         p.k % stage == 0 && aligned16(p.w) && (!fp4 || aligned16(p.w_scale)) && !gemv_w4a8_supported(p);
}
}  // namespace

bool gemv_bulk_supported(const GemvParams& p) { return gemv_bulk_enabled() && bulk_shape_ok(p); }

bool gemv_bulk_grouped_supported(const GemvGroupedParams& g) {
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool fp4 = g.base.weight != GemvWeight::FP8_BLOCK;
  return gemv_bulk_mode() == GemvBulk::All && bulk_shape_ok(g.base) && g.w_expert_stride % 16 == 0 &&
         (!fp4 || g.scale_expert_stride % 16 == 0) &&
         (!g.second.w || (aligned16(g.second.w) && (!fp4 || aligned16(g.second.w_scale))));
}

cudaError_t gemv_bulk_launch(const KernelArgs& a, const GemvParams& p, dim3 grid, bool grouped) {
  switch (p.weight) {
    case GemvWeight::MXFP4: return launch_any<Fmt::MXFP4>(a, grid, p.stream, grouped);
    case GemvWeight::NVFP4: return launch_any<Fmt::NVFP4>(a, grid, p.stream, grouped);
    case GemvWeight::FP8_BLOCK:
      return p.fp8_scale == GemvScale::E8M0 ? launch_any<Fmt::FP8_E8M0>(a, grid, p.stream, grouped)
                                            : launch_any<Fmt::FP8_F32>(a, grid, p.stream, grouped);
    case GemvWeight::BF16: break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsv4::detail
