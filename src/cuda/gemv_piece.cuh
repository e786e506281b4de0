// SPDX-License-Identifier: MIT
// What the two skinny kernels share (gemv.cu loads weights into registers, gemv_bulk.cu through a shared-memory
// ring): one thread's 16-byte piece of a weight row decoded to bf16x2 words, the m16n8k16 mma they feed, and the
// split-k sum of a block's warps through shared memory into y.
// Piece layout: within each 64-byte chunk of a row, quad thread t owns bytes 16t..16t+15 and feeds them to its own
// k-slots of the mma fragments (a dot product does not care about the order of k), so the matching activations are
// 16-byte loads from the same k range.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/dequant.cuh"
#include "cuda/gemv_launch.h"
#include "cuda/gemv_slot.cuh"

namespace dsv4::detail {

enum class Fmt { BF16, FP8_E8M0, FP8_F32, MXFP4, NVFP4 };

constexpr int kChunkBytes = 64;  // bytes of one weight row per chunk: 4 quad threads x 16 bytes

template <Fmt F>
__host__ __device__ constexpr int elems_per_16b() {  // weight elements in one thread's 16-byte piece
  return F == Fmt::BF16 ? 8 : (F == Fmt::FP8_E8M0 || F == Fmt::FP8_F32) ? 16 : 32;
}

__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One thread's 16-byte piece of one row -> bf16x2 words in element order. `scale` holds the raw scale bits
// that apply to this piece (format-specific, see the loads in the kernels).
template <Fmt F>
__device__ __forceinline__ void decode_piece(const uint4& raw, uint32_t scale, uint32_t out[elems_per_16b<F>() / 2]) {
  const uint32_t word[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (F == Fmt::BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = word[i];
  } else if constexpr (F == Fmt::FP8_E8M0 || F == Fmt::FP8_F32) {
    const uint32_t factor = F == Fmt::FP8_E8M0 ? dq::fp8_factor_e8m0(scale) : dq::fp8_factor_unit();
#pragma unroll
    for (int i = 0; i < 4; ++i) dq::e4m3x4_to_bf16x2(word[i], factor, out + 2 * i);
  } else if constexpr (F == Fmt::MXFP4) {
    const uint32_t factor = dq::mxfp4_factor(scale);
#pragma unroll
    for (int i = 0; i < 4; ++i) dq::e2m1x8_to_bf16x2(word[i], factor, out + 4 * i);
  } else {  // NVFP4: two 16-element blocks, scale bytes s0 (words 0-1) and s1 (words 2-3)
    uint32_t f0, f1;
    dq::nvfp4_factor_pair(scale, f0, f1);
#pragma unroll
    for (int i = 0; i < 4; ++i) dq::e2m1x8_to_bf16x2(word[i], i < 2 ? f0 : f1, out + 4 * i);
  }
}

// The products of one chunk: the decoded pieces of rows g and g + 8 (w_lo, w_hi) times every n-tile's activations
// at k offset kk (x_row[j] nullptr past the rows, or !in_k past k: zeros), added to acc[j]. FP8 blocks with f32
// scales sum the chunk apart and add it times its scale (the f32 bits in `scale`).
template <Fmt F, int kTilesN>
__device__ __forceinline__ void mma_chunk(float acc[kTilesN][4], const uint32_t* w_lo, const uint32_t* w_hi,
                                          const __nv_bfloat16* const* x_row, int kk, bool in_k, uint32_t scale) {
  constexpr int kPairs = elems_per_16b<F>() / 2;
  float chunk_acc[kTilesN][4];
  if constexpr (F == Fmt::FP8_F32) {
#pragma unroll
    for (int j = 0; j < kTilesN; ++j) chunk_acc[j][0] = chunk_acc[j][1] = chunk_acc[j][2] = chunk_acc[j][3] = 0.0f;
  }
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
    uint32_t xb[kPairs];
    if (x_row[j] && in_k) {
      const uint4* xp = reinterpret_cast<const uint4*>(x_row[j] + kk);
#pragma unroll
      for (int v = 0; v < kPairs / 4; ++v) {
        const uint4 q = xp[v];
        xb[4 * v + 0] = q.x, xb[4 * v + 1] = q.y, xb[4 * v + 2] = q.z, xb[4 * v + 3] = q.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPairs; ++i) xb[i] = 0;
    }
#pragma unroll
    for (int i = 0; i < kPairs / 2; ++i)
      mma_bf16(F == Fmt::FP8_F32 ? chunk_acc[j] : acc[j], w_lo[2 * i], w_hi[2 * i], w_lo[2 * i + 1], w_hi[2 * i + 1],
               xb[2 * i], xb[2 * i + 1]);
  }
  if constexpr (F == Fmt::FP8_F32) {
    const float s = __uint_as_float(scale);
#pragma unroll
    for (int j = 0; j < kTilesN; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] = fmaf(chunk_acc[j][e], s, acc[j][e]);
  }
}

// The split-k sum of the pass starting at activation row rb of the block's rows: every warp's accumulators (acc[j]
// = mma C fragment of n-tile j) go through `red` ([kGemvWarps][16][kTilesN * 8 + 1] floats, the +1 against bank
// conflicts in the read loop), the `split` warps of each of the block's tiles_per_block tiles are added in order,
// and each (row, batch row) is written once. Ends with the block past a __syncthreads; the caller syncs again
// before `red` is reused.
template <int kTilesN, bool kGrouped>
__device__ __forceinline__ void store_tile_sums(const KernelArgs& a, const BlockRows& o, int tiles_per_block,
                                                int split, int rb, const float acc[kTilesN][4], float* red) {
  constexpr int kCols = kTilesN * 8 + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  auto cell = [&](int w, int row, int col) -> float& { return red[(w * 16 + row) * kCols + col]; };
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
    cell(warp, g, 8 * j + 2 * t) = acc[j][0];
    cell(warp, g, 8 * j + 2 * t + 1) = acc[j][1];
    cell(warp, g + 8, 8 * j + 2 * t) = acc[j][2];
    cell(warp, g + 8, 8 * j + 2 * t + 1) = acc[j][3];
  }
  __syncthreads();
  const int rows_in_block = tiles_per_block * 16;
  const int n_block0 = blockIdx.x * rows_in_block;
  const int pass_rows = min(kTilesN * 8, o.m_rows - rb);
  for (int idx = threadIdx.x; idx < rows_in_block * pass_rows; idx += blockDim.x) {
    const int r = idx % rows_in_block, m = idx / rows_in_block;
    const int n = n_block0 + r;
    if (n >= a.n) continue;
    const int tl = r / 16, rr = r % 16;
    float s = 0.0f;
    for (int p = 0; p < split; ++p) s += cell(tl * split + p, rr, m);
    s *= o.y_factor;
    void* y = kGrouped && blockIdx.z == 1 ? a.y_second : a.y;
    const int row = rb + m;
    const int64_t out = o.y_offset + int64_t(kGrouped ? a.row_order[o.order0 + row] : row) * a.ldy + n;
    if (a.out_bf16)
      static_cast<__nv_bfloat16*>(y)[out] = __float2bfloat16_rn(s);
    else
      static_cast<float*>(y)[out] = s;
  }
}

}  // namespace dsv4::detail
