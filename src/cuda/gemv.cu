// SPDX-License-Identifier: MIT
// Skinny-GEMM kernels (contract in gemv.h). One warp computes a 16-row tile of W against all m rows of x with
// mma.sync m16n8k16 (A = 16 weight rows, B = 8 activation rows, so m <= 8 costs one n-tile and m = 64 eight).
// Layout trick: a dot product does not care about the order of k, so within each 64-byte row chunk quad thread
// t owns 16 contiguous bytes and feeds them to its own k-slots of the mma fragments. Weights then arrive as
// plain 16-byte loads straight from the checkpoint layout (no repacking), and the matching activations are
// 16-byte loads from the same k range. split_k warps of a block walk interleaved chunks of one tile and are
// summed through shared memory at the end; each launch reads every weight byte exactly once.
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/dequant.cuh"
#include "cuda/gemv_launch.h"
#include "cuda/gemv_piece.cuh"
#include "cuda/gemv_slot.cuh"
#include "cuda/launch.cuh"
#include "cuda/moe_route.cuh"
#include "cuda/swiglu.cuh"
#include "cuda/weight_tiles.h"

namespace dsv4::detail {
namespace {

constexpr int kThreads = kGemvWarps * 32;

// Grouped w1 + w3 (KernelArgs::swiglu_h): the last block of the slot to store its tile sums computes the SwiGLU of
// the slot's pairs from both projections' fp32 outputs (swiglu_bf16).
__device__ __forceinline__ void swiglu_after_slot(const KernelArgs& a, const BlockRows& rows) {
  if (!gpu::detail::last_block_to_arrive(a.slot_tickets + blockIdx.y, gridDim.x * gridDim.z)) return;
  const float* gate = static_cast<const float*>(a.y);
  const float* up = static_cast<const float*>(a.y_second);
  const int inter = a.n;
  for (int idx = threadIdx.x; idx < rows.m_rows * inter; idx += blockDim.x) {
    const int r = a.row_order[rows.order0 + idx / inter], j = idx % inter;
    const float w = a.swiglu_weights ? a.swiglu_weights[r] : 1.0f;
    a.swiglu_h[int64_t(r) * inter + j] =
        swiglu_bf16(__ldcg(gate + int64_t(r) * a.ldy + j), __ldcg(up + int64_t(r) * a.ldy + j), a.swiglu_limit, w);
  }
}
constexpr int kUnroll = 4;       // chunks loaded per thread before the first is used (8 x 16 B in flight; 6 or 8
                                 // fit 2 blocks per SM without spills and are 4-5 % slower at batch 1, perf.md)

// Two blocks per SM up to 4 n-tiles (m <= 32: 48-64 bytes of spills at 4 tiles, still 6-8 % faster at batch 32 than
// one block); three at m <= 8 (80 registers) spill a little and lose 8 % at batch 1 (docs/perf.md).
// kTileLayout: w / w_scale in the tile layout (cuda/weight_tiles.h; fp4 only): a warp's loads of a chunk are
// contiguous.
template <Fmt F, int kTilesN, bool kGrouped, bool kTileLayout = false>
__global__ void __launch_bounds__(kThreads, kTilesN <= 4 ? 2 : 1) gemv_kernel(const KernelArgs a) {
  static_assert(!kTileLayout || F == Fmt::MXFP4 || F == Fmt::NVFP4, "the tile layout is for fp4 weights");
  gpu::allow_dependents();
  constexpr int kElems = elems_per_16b<F>();  // per thread, per row, per chunk
  constexpr int kChunkK = 4 * kElems;
  constexpr int kPairs = kElems / 2;          // bf16x2 words per row piece
  constexpr bool kFp8 = F == Fmt::FP8_E8M0 || F == Fmt::FP8_F32;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma group (row g / g+8, batch column g) and thread in group
  const int split = a.split, tiles_per_block = kGemvWarps / split;
  const int tile = warp / split, part = warp % split;
  const int row0 = (blockIdx.x * tiles_per_block + tile) * 16;
  const int r_lo = row0 + g, r_hi = row0 + g + 8;
  const bool ok_lo = r_lo < a.n, ok_hi = r_hi < a.n;
  const int n_chunks = (a.k + kChunkK - 1) / kChunkK;
  const size_t row_bytes = F == Fmt::BF16 ? size_t(a.k) * 2 : kFp8 ? size_t(a.k) : size_t(a.k) / 2;

  // Which weights and which rows of x / y: all m rows (plain; batch blockIdx.y of a batched launch), or one
  // slot's routed pairs (grouped).
  // Grouped launches with settled slots read their slot before waiting (KernelArgs::slots_settled).
  const bool grouped_early = kGrouped && a.slots_settled;
  BlockRows rows;
  if (!block_rows<kGrouped>(a, rows, !grouped_early)) return;  // an empty slot: the whole block, before any barrier
  const uint8_t* w_base = rows.w + size_t(rows.w_row0) * row_bytes;
  const uint8_t* w_scale = rows.w_scale;
  if constexpr (F == Fmt::MXFP4) w_scale += size_t(rows.w_row0) * (a.k / 32);
  if constexpr (F == Fmt::NVFP4) w_scale += size_t(rows.w_row0) * (a.k / 16);
  // Where this thread's pieces of chunk 0 are, and how far the next chunk's are: row-major, or the tile layout
  // (weight_tiles::offset of the same bytes, written out: a tile's rows g and g + 8 are lane·piece bytes into the
  // two halves of its chunk; through offset() itself ptxas allocated registers differently and batch 1 ran 2.6 %
  // slower on the H100, docs/perf.md sixteenth round).
  namespace wt = weight_tiles;
  constexpr int kScalePiece = F == Fmt::NVFP4 ? 2 : 1;  // fp4 scale bytes per 32-element piece
  constexpr int kHalfChunk = 8 * wt::kChunkPieces;     // pieces in half a tile's chunk (rows g of 0..7)
  const uint8_t* w_lo = kTileLayout ? w_base + size_t(row0) * row_bytes + lane * wt::kWeightPiece
                                    : w_base + size_t(r_lo) * row_bytes + t * wt::kWeightPiece;
  const uint8_t* w_hi = kTileLayout ? w_lo + kHalfChunk * wt::kWeightPiece : w_lo + 8 * row_bytes;
  constexpr size_t kWChunkStride = kTileLayout ? wt::kRows * kChunkBytes : kChunkBytes;
  const size_t scale_row_bytes = size_t(a.k / 32) * kScalePiece;
  const uint8_t* s_lo = kTileLayout ? w_scale + size_t(row0) * scale_row_bytes + lane * kScalePiece
                               : w_scale + size_t(r_lo) * scale_row_bytes + t * kScalePiece;
  const uint8_t* s_hi = kTileLayout ? s_lo + kHalfChunk * kScalePiece : s_lo + 8 * scale_row_bytes;
  constexpr size_t kSChunkStride = (kTileLayout ? wt::kRows : 1) * wt::kChunkPieces * kScalePiece;
  auto pair_of = [&](int row) { return kGrouped ? a.row_order[rows.order0 + row] : row; };
  // x and y belong to the step. Under early_weights a plain / batched block (grouped: with settled slots) first
  // issues its first round of weight loads (no kernel writes weights), so that they stream while the previous kernel
  // finishes.
  gpu::WaitOnce wait{!kGrouped || grouped_early};  // other grouped blocks waited in block_rows
  if (!a.early_weights) wait();

  // More rows than the tile holds (a grouped slot above base.m) are covered by further passes over W.
  for (int rb = 0; rb < rows.m_rows; rb += kTilesN * 8) {
  const __nv_bfloat16* x_row[kTilesN];  // this thread's batch row of each n-tile, nullptr past the slot's rows
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
    const int row = rb + j * 8 + g;
    x_row[j] = row < rows.m_rows ? rows.x + size_t(kGrouped ? pair_of(row) / a.x_row_div : row) * a.k : nullptr;
  }

  float acc[kTilesN][4];
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  if (row0 < a.n) {
    for (int c0 = part; c0 < n_chunks; c0 += split * kUnroll) {
      // Issue all weight (and scale) loads of kUnroll chunks first: these are the DRAM stream.
      uint4 raw_lo[kUnroll], raw_hi[kUnroll];
      uint32_t sc_lo[kUnroll], sc_hi[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * split;
        const int kk = c * kChunkK + t * kElems;
        const bool in_k = c < n_chunks && kk < a.k;
        const uint4 zero = make_uint4(0, 0, 0, 0);
        raw_lo[u] = in_k && ok_lo ? dq::load_weights(w_lo + size_t(c) * kWChunkStride) : zero;
        raw_hi[u] = in_k && ok_hi ? dq::load_weights(w_hi + size_t(c) * kWChunkStride) : zero;
        sc_lo[u] = sc_hi[u] = 0;
        if constexpr (kFp8) {  // one scale per (128-row block, 128-k block): uniform over the warp's chunk
          if (c < n_chunks) {
            const size_t idx = size_t((rows.w_row0 + row0) / 128) * size_t((a.k + 127) / 128) + size_t(c / 2);
            sc_lo[u] = F == Fmt::FP8_E8M0 ? uint32_t(__ldg(w_scale + idx))
                                          : __ldg(reinterpret_cast<const uint32_t*>(w_scale) + idx);
          }
        } else if constexpr (F == Fmt::MXFP4) {  // [n, k/32] e8m0: one byte per 32-element piece
          if (in_k && ok_lo) sc_lo[u] = __ldg(s_lo + size_t(c) * kSChunkStride);
          if (in_k && ok_hi) sc_hi[u] = __ldg(s_hi + size_t(c) * kSChunkStride);
        } else if constexpr (F == Fmt::NVFP4) {  // [n, k/16] e4m3: two bytes per piece
          if (in_k && ok_lo) sc_lo[u] = __ldg(reinterpret_cast<const uint16_t*>(s_lo + size_t(c) * kSChunkStride));
          if (in_k && ok_hi) sc_hi[u] = __ldg(reinterpret_cast<const uint16_t*>(s_hi + size_t(c) * kSChunkStride));
        }
      }
      wait();  // before the first load of x
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = c0 + u * split;
        if (c >= n_chunks) break;  // warp-uniform, so every lane still joins each mma.sync
        const int kk = c * kChunkK + t * kElems;
        const bool in_k = kk < a.k;
        uint32_t w_lo_bf[kPairs], w_hi_bf[kPairs];
        decode_piece<F>(raw_lo[u], sc_lo[u], w_lo_bf);
        decode_piece<F>(raw_hi[u], kFp8 ? sc_lo[u] : sc_hi[u], w_hi_bf);

        mma_chunk<F, kTilesN>(acc, w_lo_bf, w_hi_bf, x_row, kk, in_k, sc_lo[u]);
      }
    }
  }

  // Split-k sum through shared memory.
  __shared__ float red[kGemvWarps * 16 * (kTilesN * 8 + 1)];
  wait();  // a warp without chunks, before its stores
  if (rb > 0) __syncthreads();  // the previous pass's reads of red are done
  store_tile_sums<kTilesN, kGrouped>(a, rows, tiles_per_block, split, rb, acc, red);
  }  // row passes
  if constexpr (kGrouped)
    if (a.swiglu_h) swiglu_after_slot(a, rows);
}

template <Fmt F, bool kGrouped, bool kTileLayout>
void launch_for_m(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  if (a.m <= 8)
    gpu::launch(gemv_kernel<F, 1, kGrouped, kTileLayout>, grid, kThreads, 0, stream, a);
  else if (a.m <= 16)
    gpu::launch(gemv_kernel<F, 2, kGrouped, kTileLayout>, grid, kThreads, 0, stream, a);
  else if (a.m <= 32)
    gpu::launch(gemv_kernel<F, 4, kGrouped, kTileLayout>, grid, kThreads, 0, stream, a);
  else
    gpu::launch(gemv_kernel<F, 8, kGrouped, kTileLayout>, grid, kThreads, 0, stream, a);
}

template <Fmt F, bool kGrouped>
cudaError_t launch_fmt(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  const int rows_per_block = kGemvWarps / a.split * 16;
  grid.x = (a.n + rows_per_block - 1) / rows_per_block;
  if constexpr (F == Fmt::MXFP4 || F == Fmt::NVFP4)
    if (a.tiles) {
      launch_for_m<F, kGrouped, true>(a, grid, stream);
      return cudaGetLastError();
    }
  if (a.tiles) return cudaErrorInvalidValue;  // gemv.cpp refuses the tile layout for other formats
  launch_for_m<F, kGrouped, false>(a, grid, stream);
  return cudaGetLastError();
}

// grid.y: batches or slots; grid.z: projections of a grouped launch (grid.x is set from the rows).
template <bool kGrouped>
cudaError_t launch(const GemvParams& p, const KernelArgs& a, dim3 grid) {
  switch (p.weight) {
    case GemvWeight::BF16: return launch_fmt<Fmt::BF16, kGrouped>(a, grid, p.stream);
    case GemvWeight::FP8_BLOCK:
      return p.fp8_scale == GemvScale::E8M0 ? launch_fmt<Fmt::FP8_E8M0, kGrouped>(a, grid, p.stream)
                                            : launch_fmt<Fmt::FP8_F32, kGrouped>(a, grid, p.stream);
    case GemvWeight::MXFP4: return launch_fmt<Fmt::MXFP4, kGrouped>(a, grid, p.stream);
    case GemvWeight::NVFP4: return launch_fmt<Fmt::NVFP4, kGrouped>(a, grid, p.stream);
  }
  return cudaErrorInvalidValue;
}

KernelArgs plain_args(const GemvParams& p, int split_k) {
  KernelArgs a{};
  a.m = p.m, a.n = p.n, a.k = p.k, a.split = split_k;
  a.x = static_cast<const uint16_t*>(p.x);
  a.w = static_cast<const uint8_t*>(p.w);
  a.w_scale = static_cast<const uint8_t*>(p.w_scale);
  a.y = p.y;
  a.ldy = p.ldy ? p.ldy : p.n;
  a.w_row0 = p.w_row0;
  a.y_factor = p.weight == GemvWeight::NVFP4 ? p.w_scale_2 * dq::kNvfp4OutputFactor : 1.0f;
  a.out_bf16 = p.out == GemvOut::BF16;
  a.tiles = p.layout == GemvLayout::Tiles;
  a.early_weights = gpu::early_gemv_weights();
  a.x_row_div = 1;
  return a;
}

// One block of 1024 threads: place_pairs (warp 0 places every pair), or place_pairs_by_warps where its per-warp
// counts fit (set_moe_slots_by_warps). smem: theirs.
constexpr int kSlotsThreads = 1024;
__global__ void __launch_bounds__(kSlotsThreads) moe_slots_kernel(MoeSlotsParams p, bool by_warps) {
  gpu::dependent_enter();
  extern __shared__ int slots_smem[];
  if (by_warps)
    place_pairs_by_warps(p, slots_smem);
  else
    place_pairs(p, slots_smem, slots_smem + p.experts);
}

// The router's 16 warps take the step's tokens (warp w: tokens w, w + 16, ..), each with its E floats of shared memory;
// after the barrier the block places the pairs (the router's ids and weights, written to global memory by this
// block, are visible to it after __syncthreads).
constexpr int kRouteThreads = 512;  // 16 warps: registers for the router's per-lane arrays without spills

template <int kPerLane>
__global__ void __launch_bounds__(kRouteThreads) moe_route_and_slots_kernel(gpu::RouterParams r, MoeSlotsParams p) {
  gpu::dependent_enter();
  extern __shared__ float route_smem[];
  route_and_place<kPerLane>(r, p, kRouteThreads / 32, route_smem);
}

template <int kPerLane>
cudaError_t launch_route_and_slots(const gpu::RouterParams& r, const MoeSlotsParams& p) {
  const size_t smem = (size_t(kRouteThreads / 32) * r.experts + 2 * size_t(p.experts)) * sizeof(float);
  const cudaError_t attr = gpu::allow_dynamic_smem<moe_route_and_slots_kernel<kPerLane>>(
      int((kRouteThreads / 32 * 512 + 2 * 4096) * sizeof(float)));
  if (attr != cudaSuccess) return attr;
  gpu::launch(moe_route_and_slots_kernel<kPerLane>, 1, kRouteThreads, smem, p.stream, r, p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t moe_route_and_slots_launch(const gpu::RouterParams& r, const MoeSlotsParams& p) {
  // As gpu::router picks them, up to 16 (<= 512 experts, the launcher's check: 32 per lane would spill here).
  return with_experts_per_lane<16>(r.experts, [&](auto per_lane) { return launch_route_and_slots<per_lane>(r, p); });
}

cudaError_t gemv_launch(const GemvParams& p, int split_k) {
  if (gemv_tiled_supported(p)) return gemv_tiled_launch(plain_args(p, split_k), p, dim3(1, 1, 1), false);
  if (gemv_w4a8_supported(p)) return gemv_w4a8_launch(plain_args(p, split_k), p, dim3(1, 1, 1), false);
  if (gemv_bulk_supported(p)) return gemv_bulk_launch(plain_args(p, split_k), p, dim3(1, 1, 1), false);
  return launch<false>(p, plain_args(p, split_k), dim3(1, 1, 1));
}

cudaError_t gemv_batched_launch(const GemvBatchedParams& b, int split_k) {
  KernelArgs a = plain_args(b.base, split_k);
  a.x_batch_stride = b.x_batch_stride;
  a.y_batch_stride = b.y_batch_stride;
  if (gemv_tiled_supported(b.base, b.batch)) return gemv_tiled_launch(a, b.base, dim3(1, b.batch, 1), false);
  if (gemv_bulk_supported(b.base)) return gemv_bulk_launch(a, b.base, dim3(1, b.batch, 1), false);
  return launch<false>(b.base, a, dim3(1, b.batch, 1));
}

cudaError_t gemv_grouped_launch(const GemvGroupedParams& g, int split_k, bool* swiglu_done) {
  *swiglu_done = false;
  KernelArgs a = plain_args(g.base, split_k);
  a.w_stride = g.w_expert_stride;
  a.scale_stride = g.scale_expert_stride;
  a.scale_2 = g.base.weight == GemvWeight::NVFP4 ? g.scale_2 : nullptr;
  a.nvfp4_factor = dq::kNvfp4OutputFactor;
  a.slot_count = g.slots.count;
  a.slot_expert = g.slots.expert;
  a.slot_offset = g.slots.offset;
  a.row_order = g.slots.row_order;
  a.x_row_div = g.x_row_div;
  a.slots_settled = g.slots_settled && a.early_weights;
  a.w_second = static_cast<const uint8_t*>(g.second.w);
  a.w_scale_second = static_cast<const uint8_t*>(g.second.w_scale);
  a.scale_2_second = g.base.weight == GemvWeight::NVFP4 ? g.second.scale_2 : nullptr;
  a.y_second = g.second.y;
  const dim3 grid(1, g.max_slots, g.second.w ? 2 : 1);
  const GroupedKernel kernel = grouped_kernel(g);
  // The register kernel and the tiled kernel's paired wgmma blocks compute the SwiGLU; the others leave it.
  if (g.swiglu.h && (kernel == GroupedKernel::Register || kernel == GroupedKernel::Tiled)) {
    a.swiglu_h = g.swiglu.h;
    a.swiglu_weights = g.swiglu.weights;
    a.swiglu_limit = g.swiglu.limit;
    a.slot_tickets = g.slot_tickets;
  }
  switch (kernel) {
    case GroupedKernel::Tiled: return gemv_tiled_launch(a, g.base, grid, true, swiglu_done);
    case GroupedKernel::W4a8: return gemv_w4a8_launch(a, g.base, grid, true);
    case GroupedKernel::Bulk: return gemv_bulk_launch(a, g.base, grid, true);
    case GroupedKernel::Register: break;
  }
  *swiglu_done = a.swiglu_h != nullptr;
  return launch<true>(g.base, a, grid);
}

GroupedKernel grouped_kernel(const GemvGroupedParams& g) {
  if (gemv_tiled_supported(g.base, gemv_grouped_matrices(g))) return GroupedKernel::Tiled;
  if (gemv_w4a8_supported(g.base)) return GroupedKernel::W4a8;
  if (gemv_bulk_grouped_supported(g)) return GroupedKernel::Bulk;
  return GroupedKernel::Register;
}

cudaError_t moe_slots_launch(const MoeSlotsParams& p, bool by_warps) {
  // By warps: per-warp counts, count and start for <= kSlotsWarpExperts experts, and a uint16 expert per pair (132 KB
  // at most); one warp: count and start for <= 4096 experts (32 KB).
  constexpr int kMaxSmem = (kSlotsThreads / 32 + 2) * kSlotsWarpExperts * 4 + kMoeSlotsMaxPairs * 2;
  const cudaError_t attr = gpu::allow_dynamic_smem<moe_slots_kernel>(kMaxSmem);
  if (attr != cudaSuccess) return attr;
  const int pairs = p.n * (p.k + (p.shared_expert >= 0 ? 1 : 0));
  by_warps = by_warps && p.experts <= kSlotsWarpExperts;
  const size_t smem = by_warps
                          ? size_t(kSlotsThreads / 32 + 2) * p.experts * sizeof(int) + size_t(pairs) * sizeof(uint16_t)
                          : 2 * size_t(p.experts) * sizeof(int);
  gpu::launch(moe_slots_kernel, 1, kSlotsThreads, smem, p.stream, p, by_warps);
  return cudaGetLastError();
}

}  // namespace dsv4::detail
