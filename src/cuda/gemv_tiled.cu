// SPDX-License-Identifier: MIT
// The tiled tensor-core kernel behind gemv() for m > kGemvMaxM (prefill chunks) and, when gemv_tiled_min_rows is
// lowered, decode batches (contract in gemv.h).
// A block computes 256 weight rows x 64 activation rows (128 x 64 when that leaves SMs idle): each of its 8 warps
// owns two (one) 16-row weight tiles, decodes them from the checkpoint bytes in registers exactly like the skinny
// kernel (same per-thread 16-byte pieces, same k permutation), and multiplies them against 64 activation rows. Per
// k-chunk the block stages the activation tile and its 64-byte weight slices in shared memory (cp.async, four
// stages; the scale bits come one chunk ahead through registers), so an activation fragment feeds the warp's weight
// tiles and a weight fragment eight activation tiles. The outputs go through shared memory so that each token's
// row is stored coalesced. Blocks of one weight tile and consecutive row tiles are adjacent in the grid, so the
// weight bytes come from DRAM about once and from L2 for the other row tiles.
// FP8 block weights with f32 scales are not handled here (gemv.cpp runs the skinny kernel for them).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include "cuda/dequant.cuh"
#include "cuda/device.h"
#include "cuda/gemv_launch.h"
#include "cuda/gemv_slot.cuh"
#include "cuda/gemv_tile_io.cuh"
#include "cuda/launch.cuh"
#include "cuda/mma.cuh"
#include "cuda/weight_tiles.h"

namespace dsv4::detail {
namespace {

enum class Fmt { BF16, FP8, MXFP4, NVFP4 };

constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kStages = 4;

template <Fmt F>
__host__ __device__ constexpr int piece_elems() {  // weight elements in one thread's 16-byte piece of a row
  return F == Fmt::BF16 ? 8 : F == Fmt::FP8 ? 16 : 32;
}
template <Fmt F>
__host__ __device__ constexpr int chunk_k() {  // k per chunk: the four quad threads' pieces of a 64-byte row slice
  return 4 * piece_elems<F>();
}

// Shared-memory position (in 16-byte units, within a token's row of the stage) of logical 8-element chunk c of
// token `tok`. Readers are the 8 lanes (g = 0..1, t = 0..3) of a quarter warp, reading chunk t·(piece/8) + cc of
// tokens g: the XORs put those 8 reads in 8 different bank groups.
template <Fmt F>
__device__ __forceinline__ int swizzle(int c, int tok) {
  if constexpr (F == Fmt::BF16) return c;  // 64-byte rows: token parity already alternates the bank halves
  else if constexpr (F == Fmt::FP8) return c ^ (tok & 1);
  else return c ^ ((c >> 2) & 2) ^ (tok & 1);
}

// Decoder factors of a piece (see dequant.cuh); NVFP4 has one per 16-element half.
template <Fmt F>
__device__ __forceinline__ void piece_factors(uint32_t scale, uint32_t f[2]) {
  if constexpr (F == Fmt::FP8) f[0] = f[1] = dq::fp8_factor_e8m0(scale);
  else if constexpr (F == Fmt::MXFP4) f[0] = f[1] = dq::mxfp4_factor(scale);
  else if constexpr (F == Fmt::NVFP4) dq::nvfp4_factor_pair(scale, f[0], f[1]);
  else f[0] = f[1] = 0;
}

// Elements 8·cc .. 8·cc + 7 of a piece as four bf16x2 words (element order).
template <Fmt F>
__device__ __forceinline__ void decode_eight(const uint4& raw, int cc, const uint32_t f[2], uint32_t out[4]) {
  const uint32_t word[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (F == Fmt::BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = word[i];
  } else if constexpr (F == Fmt::FP8) {
    dq::e4m3x4_to_bf16x2(word[2 * cc], f[0], out);
    dq::e4m3x4_to_bf16x2(word[2 * cc + 1], f[0], out + 2);
  } else {
    dq::e2m1x8_to_bf16x2(word[cc], f[cc >> 1], out);
  }
}

// Shared memory of one block: kStages stages of (activation tile, weight tile), reused by the epilogue as the
// [kBlockTokens][kBlockRows] fp32 output tile.
// kWeightTiles: 16-row weight tiles per warp (2: one block of 256 rows per SM; 1: two blocks of 128 rows).
// kTokenTiles: 8-row activation tiles (mma n-tiles) per block: 8 (64 rows) for prefill chunks, 2 or 4 when the
// call has at most 16 or 32 rows (decode batches from gemv_tiled_min_rows).
template <Fmt F, int kWeightTiles, int kTokenTiles>
struct TiledSmem {
  static constexpr int kBlockRows = kWarps * kWeightTiles * 16;  // weight rows per block
  static constexpr int kBlockTokens = kTokenTiles * 8;           // activation rows per block
  static constexpr int kXUnits = kBlockTokens * chunk_k<F>() / 8;  // 16-byte units per stage
  static constexpr int kWUnits = kBlockRows * 4;                    // 64 bytes of each weight row per stage
  static constexpr int kOutStride = kBlockRows + 4;                 // floats per token row of the output tile
  static constexpr size_t kStageBytes = size_t(kXUnits + kWUnits) * 16;
  static constexpr size_t kBytes = std::max(kStages * kStageBytes, size_t(kBlockTokens) * kOutStride * 4);
};

template <Fmt F, bool kGrouped, int kWeightTiles, int kTokenTiles>
__global__ void __launch_bounds__(kThreads, kWeightTiles == 1 ? 2 : 1) gemv_tiled_kernel(const KernelArgs a) {
  gpu::allow_dependents();
  using S = TiledSmem<F, kWeightTiles, kTokenTiles>;
  constexpr int kBlockRows = S::kBlockRows, kBlockTokens = S::kBlockTokens;
  constexpr int kPiece = piece_elems<F>(), kChunkK = chunk_k<F>();
  constexpr int kRowChunks = kChunkK / 8;            // 16-byte units per token per stage
  // cp.async per thread per stage (small activation tiles of bf16 / fp8 rows leave some threads without one)
  constexpr int kXCopies = (S::kXUnits + kThreads - 1) / kThreads;
  constexpr bool kXAll = S::kXUnits % kThreads == 0;
  constexpr int kWCopies = S::kWUnits / kThreads;
  static_assert(S::kWUnits % kThreads == 0);
  extern __shared__ __align__(16) uint4 smem[];
  auto x_stage = [&](int c) { return smem + (c % kStages) * (S::kXUnits + S::kWUnits); };
  auto w_stage = [&](int c) { return smem + (c % kStages) * (S::kXUnits + S::kWUnits) + S::kXUnits; };

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int token_blocks = int(gridDim.x) / ((a.n + kBlockRows - 1) / kBlockRows);
  const int tok_first = int(blockIdx.x) % token_blocks * kBlockTokens;
  const int row_block0 = int(blockIdx.x) / token_blocks * kBlockRows;
  const size_t row_bytes = F == Fmt::BF16 ? size_t(a.k) * 2 : F == Fmt::FP8 ? size_t(a.k) : size_t(a.k) / 2;

  BlockRows rows;
  if (!block_rows<kGrouped>(a, rows)) return;  // an empty slot: the whole block, before any barrier
  // Grouped grids give every slot the token blocks of the most rows any slot may hold: most find no rows.
  if (tok_first >= rows.m_rows) return;
  auto pair_of = [&](int row) { return kGrouped ? a.row_order[rows.order0 + row] : row; };

  // fp4 weights in the tile layout (weight_tiles.h): a row's 64-byte slice of chunk c is 4 pieces of 16 bytes
  // spread over the tile's KB of that chunk.
  const bool tiles = (F == Fmt::MXFP4 || F == Fmt::NVFP4) && a.tiles;
  const size_t w_chunk_stride = tiles ? 16 * 64 : 64;
  const uint8_t* w_base = rows.w + size_t(rows.w_row0) * row_bytes;
  const uint8_t* w_scale = rows.w_scale;
  if constexpr (F == Fmt::MXFP4) w_scale += size_t(rows.w_row0) * (a.k / 32);
  if constexpr (F == Fmt::NVFP4) w_scale += size_t(rows.w_row0) * (a.k / 16);
  const int n_chunks = (a.k + kChunkK - 1) / kChunkK;
  // This thread's weight rows in the block's tile: (warp·2 + wt)·16 + g (+ 8 for hi); its piece is bytes t·16.
  int local[kWeightTiles][2];
#pragma unroll
  for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
    for (int h = 0; h < 2; ++h) local[wt][h] = (warp * kWeightTiles + wt) * 16 + g + 8 * h;

  // The raw scale bits of this thread's pieces of chunk c (direct loads, one chunk ahead: they are small).
  auto load_scales = [&](int c, uint32_t sc[kWeightTiles][2]) {
    const int kk = c * kChunkK + t * kPiece;
#pragma unroll
    for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = row_block0 + local[wt][h];
        const bool ok = c < n_chunks && kk < a.k && r < a.n;
        uint32_t v = 0;
        if constexpr (F == Fmt::FP8) {  // [ceil(n/128), ceil(k/128)] e8m0, one per 128 x 128 block
          if (ok) v = __ldg(w_scale + size_t((rows.w_row0 + r) / 128) * size_t((a.k + 127) / 128) + size_t(kk / 128));
        } else if constexpr (F == Fmt::MXFP4) {  // fp4_piece_scale, written out (see store_output_tile below)
          const size_t at = tiles ? weight_tiles::offset(size_t(r), size_t(kk / 32), size_t(a.k / 32), 1)
                                  : size_t(r) * (a.k / 32) + kk / 32;
          if (ok) v = __ldg(w_scale + at);
        } else if constexpr (F == Fmt::NVFP4) {
          const size_t at = tiles ? weight_tiles::offset(size_t(r), size_t(kk / 16), size_t(a.k / 16), 2)
                                  : size_t(r) * (a.k / 16) + kk / 16;
          if (ok) v = __ldg(reinterpret_cast<const uint16_t*>(w_scale + at));
        }
        sc[wt][h] = v;
      }
  };

  // Weight pieces this thread copies into every stage: row idx / 4 of the tile, piece idx % 4.
  const uint8_t* w_src[kWCopies];
  int w_piece_k[kWCopies];
#pragma unroll
  for (int i = 0; i < kWCopies; ++i) {
    const int idx = threadIdx.x + i * kThreads, r = row_block0 + idx / 4;
    w_piece_k[i] = (idx % 4) * kPiece;
    const size_t at = tiles ? weight_tiles::offset(size_t(r), size_t(idx % 4) * 16, row_bytes, 16)
                            : size_t(r) * row_bytes + (idx % 4) * 16;
    w_src[i] = r < a.n ? w_base + at : nullptr;
  }

  // x and y belong to the step. Under a.early_weights a plain / batched block first issues its first stages'
  // weight copies and scale loads (no kernel writes weights), then waits.
  const bool early = !kGrouped && a.early_weights;
  if (!kGrouped && !early) gpu::dependent_wait();
  bool first_pass = true;
  // Activation rows tok0 .. tok0 + kBlockTokens - 1 (more rows than the grid's row tiles cover take further passes).
  for (int tok0 = tok_first; tok0 < rows.m_rows; tok0 += token_blocks * kBlockTokens) {
  const int tokens = min(kBlockTokens, rows.m_rows - tok0);
  // The activation rows this thread copies into every stage (fixed token and 16-byte unit per copy).
  const __nv_bfloat16* x_src[kXCopies];
  int x_dst[kXCopies], x_unit[kXCopies];
#pragma unroll
  for (int i = 0; i < kXCopies; ++i) {
    const int idx = threadIdx.x + i * kThreads, tok = idx / kRowChunks, c = idx % kRowChunks;
    x_unit[i] = c;
    x_dst[i] = tok * kRowChunks + swizzle<F>(c, tok);
    x_src[i] = tok < tokens && (kXAll || idx < S::kXUnits)
                   ? rows.x + size_t(kGrouped ? pair_of(tok0 + tok) / a.x_row_div : tok0 + tok) * a.k
                   : nullptr;
  }
  auto copy_x = [&](int c) {
    if (c >= n_chunks) return;
    uint4* xs = x_stage(c);
#pragma unroll
    for (int i = 0; i < kXCopies; ++i) {
      if (!kXAll && threadIdx.x + i * kThreads >= S::kXUnits) continue;  // no unit: no copy (it would zero-fill)
      const int kk = c * kChunkK + x_unit[i] * 8;
      const bool valid = x_src[i] && kk < a.k;
      cp_async_16(xs + x_dst[i], valid ? x_src[i] + kk : rows.x, valid);
    }
  };
  auto copy_w = [&](int c) {
    if (c >= n_chunks) return;
    uint4* ws = w_stage(c);
#pragma unroll
    for (int i = 0; i < kWCopies; ++i) {
      const bool valid = w_src[i] && c * kChunkK + w_piece_k[i] < a.k;
      cp_async_16(ws + threadIdx.x + i * kThreads, valid ? w_src[i] + size_t(c) * w_chunk_stride : a.w, valid);
    }
  };
  auto copy_stage = [&](int c) {
    copy_x(c);
    copy_w(c);
    cp_async_commit();  // empty groups keep the wait counts uniform
  };

  float acc[kWeightTiles][kTokenTiles][4];
#pragma unroll
  for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
    for (int j = 0; j < kTokenTiles; ++j) acc[wt][j][0] = acc[wt][j][1] = acc[wt][j][2] = acc[wt][j][3] = 0.0f;

  uint32_t sc_cur[kWeightTiles][2], sc_next[kWeightTiles][2];
  load_scales(0, sc_cur);
  if (early && first_pass) {
    // Weight groups first, then the activation groups after the wait: the loop's wait for all but the newest
    // kStages - 2 groups still covers stage c's weights and activations.
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      copy_w(s);
      cp_async_commit();
    }
    gpu::dependent_wait();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      copy_x(s);
      cp_async_commit();
    }
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) copy_stage(s);
  }
  first_pass = false;
  for (int c = 0; c < n_chunks; ++c) {
    load_scales(c + 1, sc_next);
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage c is complete for every thread; stage c - 1 is no longer read
    copy_stage(c + kStages - 1);
    const uint4* xs = x_stage(c);
    const uint4* ws = w_stage(c);
    uint4 raw[kWeightTiles][2];
    uint32_t f[kWeightTiles][2][2];
#pragma unroll
    for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        raw[wt][h] = ws[local[wt][h] * 4 + t];
        piece_factors<F>(sc_cur[wt][h], f[wt][h]);
      }
#pragma unroll
    for (int cc = 0; cc < kPiece / 8; ++cc) {
      uint32_t wa[kWeightTiles][2][4];  // [tile][lo/hi][word]
#pragma unroll
      for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
        for (int h = 0; h < 2; ++h) decode_eight<F>(raw[wt][h], cc, f[wt][h], wa[wt][h]);
      const int unit_c = t * (kPiece / 8) + cc;
#pragma unroll
      for (int j = 0; j < kTokenTiles; ++j) {
        // n-tiles past the block's rows (a slot's few pairs at decode): all zeros. Not in the 64-row variant,
        // where the branch cost the prefill's grouped GEMM 15 % (less interleaving: 177 registers instead of 240).
        if (kTokenTiles < 8 && j * 8 >= tokens) break;
        const int tok = j * 8 + g;
        const uint4 xb = xs[tok * kRowChunks + swizzle<F>(unit_c, tok)];
#pragma unroll
        for (int wt = 0; wt < kWeightTiles; ++wt) {
          const uint32_t a0[4] = {wa[wt][0][0], wa[wt][1][0], wa[wt][0][1], wa[wt][1][1]};
          const uint32_t a1[4] = {wa[wt][0][2], wa[wt][1][2], wa[wt][0][3], wa[wt][1][3]};
          mma_bf16(acc[wt][j], a0, xb.x, xb.y);
          mma_bf16(acc[wt][j], a1, xb.z, xb.w);
        }
      }
    }
#pragma unroll
    for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
      for (int h = 0; h < 2; ++h) sc_cur[wt][h] = sc_next[wt][h];
  }
  cp_async_wait<0>();
  __syncthreads();  // every stage read: the output tile reuses them

  // acc[wt][j] = {(row g, token 2t), (row g, token 2t+1), (row g+8, token 2t), (row g+8, token 2t+1)} -> the
  // [token][row] tile in shared memory, then each token's row of outputs with consecutive threads on consecutive
  // columns (coalesced stores).
  float* tile = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int wt = 0; wt < kWeightTiles; ++wt)
#pragma unroll
    for (int j = 0; j < kTokenTiles; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        tile[(j * 8 + 2 * t + (e & 1)) * S::kOutStride + local[wt][e >> 1]] = acc[wt][j][e] * rows.y_factor;
  __syncthreads();
  // store_output_tile (gemv_tile_io.cuh), written out: through the helpers ptxas allocated this kernel's registers
  // differently (every variant; BF16 prefill 0.5 % slower on the H100, docs/perf.md seventeenth round).
  void* y = kGrouped && blockIdx.z == 1 ? a.y_second : a.y;
  const int cols = min(kBlockRows, a.n - row_block0);
  for (int tok = warp; tok < tokens; tok += kWarps) {
    const int64_t out_row = rows.y_offset + int64_t(pair_of(tok0 + tok)) * a.ldy + row_block0;
    for (int col = lane; col < cols; col += 32) {
      const float v = tile[tok * S::kOutStride + col];
      if (a.out_bf16)
        static_cast<__nv_bfloat16*>(y)[out_row + col] = __float2bfloat16_rn(v);
      else
        static_cast<float*>(y)[out_row + col] = v;
    }
  }
  __syncthreads();  // the tile is read: a further pass may refill the stages
  }  // row passes
}

template <Fmt F, bool kGrouped, int kWeightTiles, int kTokenTiles>
cudaError_t launch_fmt(const KernelArgs& a, dim3 grid, cudaStream_t stream) {
  using S = TiledSmem<F, kWeightTiles, kTokenTiles>;
  constexpr auto kKernel = gemv_tiled_kernel<F, kGrouped, kWeightTiles, kTokenTiles>;
  const int token_blocks = (a.m + S::kBlockTokens - 1) / S::kBlockTokens;
  grid.x = unsigned((a.n + S::kBlockRows - 1) / S::kBlockRows * token_blocks);
  constexpr size_t smem = S::kBytes;
  const cudaError_t configured = gpu::allow_dynamic_smem<kKernel>(int(smem));
  if (configured != cudaSuccess) return configured;
  gpu::launch(kKernel, grid, kThreads, smem, stream, a);
  return cudaGetLastError();
}

template <Fmt F, int kTokenTiles>
cudaError_t launch_tokens(const KernelArgs& a, dim3 grid, cudaStream_t stream, bool grouped) {
  // One tile per warp when 256-row blocks would leave SMs idle (dsv4_gemm_bench: same speed on large grids, up to
  // 1.6x faster on small ones, e.g. 1024 x 4096 at m = 128).
  const int64_t token_blocks = (a.m + kTokenTiles * 8 - 1) / (kTokenTiles * 8);
  const int64_t big_blocks = int64_t((a.n + 255) / 256) * token_blocks * grid.y * grid.z;
  const int tiles = tiled_weight_tiles ? tiled_weight_tiles : big_blocks < 2 * int64_t(current_sm_count()) ? 1 : 2;
  if (tiles == 1)
    return grouped ? launch_fmt<F, true, 1, kTokenTiles>(a, grid, stream)
                   : launch_fmt<F, false, 1, kTokenTiles>(a, grid, stream);
  return grouped ? launch_fmt<F, true, 2, kTokenTiles>(a, grid, stream)
                 : launch_fmt<F, false, 2, kTokenTiles>(a, grid, stream);
}

template <Fmt F>
cudaError_t launch_any(const KernelArgs& a, dim3 grid, cudaStream_t stream, bool grouped, bool* swiglu_done) {
  // The narrowest activation tile that holds the call's rows (grouped: the most any slot holds) in one pass.
  if (a.m <= 16) return launch_tokens<F, 2>(a, grid, stream, grouped);
  if (a.m <= 32) return launch_tokens<F, 4>(a, grid, stream, grouped);
  if constexpr (F == Fmt::MXFP4 || F == Fmt::NVFP4)
    if (gemv_wgmma_enabled())
      if (const int shape = gemv_wgmma_pick_shape(a, grid)) {
        if (swiglu_done) *swiglu_done = grouped && a.swiglu_h && gemv_wgmma_computes_swiglu(shape);
        return gemv_wgmma_launch(a, F == Fmt::NVFP4 ? GemvWeight::NVFP4 : GemvWeight::MXFP4, shape, grid, stream,
                                 grouped);
      }
  return launch_tokens<F, 8>(a, grid, stream, grouped);
}

}  // namespace

int tiled_weight_tiles = 0;

bool gemv_tiled_supported(const GemvParams& p, int64_t matrices) {
  if (p.weight == GemvWeight::FP8_BLOCK && p.fp8_scale == GemvScale::F32) return false;
  if (p.m > kGemvMaxM) return true;
  const int min_rows = gemv_tiled_min_rows();
  if (p.m < (p.weight == GemvWeight::BF16 ? std::min(2 * min_rows, kGemvMaxM + 1) : min_rows)) return false;
  const int64_t blocks = (int64_t(p.n) + 127) / 128 * std::max<int64_t>(matrices, 1);
  return blocks >= int64_t(gemv_tiled_min_blocks_per_sm()) * current_sm_count();
}

cudaError_t gemv_tiled_launch(const KernelArgs& a, const GemvParams& p, dim3 grid, bool grouped, bool* swiglu_done) {
  if (swiglu_done) *swiglu_done = false;
  switch (p.weight) {
    case GemvWeight::BF16: return launch_any<Fmt::BF16>(a, grid, p.stream, grouped, swiglu_done);
    case GemvWeight::FP8_BLOCK: return launch_any<Fmt::FP8>(a, grid, p.stream, grouped, swiglu_done);
    case GemvWeight::MXFP4: return launch_any<Fmt::MXFP4>(a, grid, p.stream, grouped, swiglu_done);
    case GemvWeight::NVFP4: return launch_any<Fmt::NVFP4>(a, grid, p.stream, grouped, swiglu_done);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dsv4::detail
