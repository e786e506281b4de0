// SPDX-License-Identifier: MIT
// For the two tiled prefill kernels (gemv_tiled.cu on mma.sync, gemv_wgmma.cu on wgmma): the cp.async stage copies,
// the raw scale bits of an fp4 weight piece in either layout, and the epilogues that store a block's [token][row]
// output tile coalesced (gemv_tiled.cu writes the last two out: see there) or its paired w1 + w3 SwiGLU.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/gemv_launch.h"
#include "cuda/gemv_slot.cuh"
#include "cuda/mma.cuh"
#include "cuda/weight_tiles.h"
#include "cuda/swiglu.cuh"

namespace dsv4::detail {

// The raw scale bits of the 32-element piece of weight row r at k = kk (NVFP4: its two e4m3 bytes; MXFP4: its e8m0
// byte), w_scale pointing at the call's first row, in the row-major or the tile layout (weight_tiles.h).
template <bool kNvfp4>
__device__ __forceinline__ uint32_t fp4_piece_scale(const uint8_t* w_scale, bool tiles, int r, int kk, int k) {
  if constexpr (kNvfp4) {
    const size_t at = tiles ? weight_tiles::offset(size_t(r), size_t(kk / 16), size_t(k / 16), 2)
                            : size_t(r) * (k / 16) + kk / 16;
    return __ldg(reinterpret_cast<const uint16_t*>(w_scale + at));
  } else {
    const size_t at = tiles ? weight_tiles::offset(size_t(r), size_t(kk / 32), size_t(k / 32), 1)
                            : size_t(r) * (k / 32) + kk / 32;
    return __ldg(w_scale + at);
  }
}

// y[pair_of(tok0 + tok), row_block0 + col] = tile[tok · out_stride + col] for tok < tokens, col < the block's rows
// (fp32 or bf16 per a.out_bf16; grouped: the second projection's y for blockIdx.z == 1). Each of the block's kWarps
// warps stores token rows with consecutive lanes on consecutive columns.
template <bool kGrouped, int kWarps, class PairOf>
__device__ __forceinline__ void store_output_tile(const KernelArgs& a, const BlockRows& rows, const float* tile,
                                                  int out_stride, int tokens, int tok0, int row_block0,
                                                  int block_rows, PairOf pair_of) {
  void* y = kGrouped && blockIdx.z == 1 ? a.y_second : a.y;
  const int cols = min(block_rows, a.n - row_block0);
  for (int tok = threadIdx.x >> 5; tok < tokens; tok += kWarps) {
    const int64_t out_row = rows.y_offset + int64_t(pair_of(tok0 + tok)) * a.ldy + row_block0;
    for (int col = threadIdx.x & 31; col < cols; col += 32) {
      const float v = tile[tok * out_stride + col];
      if (a.out_bf16)
        static_cast<__nv_bfloat16*>(y)[out_row + col] = __float2bfloat16_rn(v);
      else
        static_cast<float*>(y)[out_row + col] = v;
    }
  }
}

// The paired w1 + w3 epilogue (KernelArgs::swiglu_h): tile columns [0, cols) hold the first projection's outputs
// of columns row_block0 .. of the token's row, [cols, 2 · cols) the second's of the same columns. Stores
// h[pair, row_block0 + col] = swiglu_bf16 of the two for col < min(cols, n - row_block0), kWarps warps by token.
template <int kWarps, class PairOf>
__device__ __forceinline__ void store_swiglu_tile(const KernelArgs& a, const float* tile, int out_stride, int cols,
                                                  int tokens, int tok0, int row_block0, PairOf pair_of) {
  const int inter = a.n, valid = min(cols, inter - row_block0);
  const float limit = a.swiglu_limit;
  for (int tok = threadIdx.x >> 5; tok < tokens; tok += kWarps) {
    const int r = pair_of(tok0 + tok);
    const float w = a.swiglu_weights ? a.swiglu_weights[r] : 1.0f;
    uint16_t* h = a.swiglu_h + int64_t(r) * inter + row_block0;
    for (int col = threadIdx.x & 31; col < valid; col += 32) {
      h[col] = swiglu_bf16(tile[tok * out_stride + col], tile[tok * out_stride + cols + col], limit, w);
    }
  }
}

}  // namespace dsv4::detail
