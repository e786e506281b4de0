// SPDX-License-Identifier: MIT
// FP4 weights x FP8 activations for one activation row (decode), the official reference's FP4 GEMM (spec 7.3,
// 8.1): x is quantised per 128-element block with a power-of-two scale (act_quant_fp8 in gemv.h), e2m1 codes
// become e4m3 exactly, the products run on the FP8 tensor cores (mma.sync m16n8k32 e4m3, fp32 accumulate) and
// the block scales are applied to fp32 partial sums.
//
// What it saves against the bf16 kernel of gemv.cu: no weight is multiplied by its scale, and an mma takes 32
// weights instead of 16 (an e2m1 code still needs moving bits: 17 integer ops per 8 weights from the device layout
// of fp4_layout.h, against 9 and 4 bf16 multiplies in the bf16 kernel). The price is that a block scale must
// multiply a partial sum that holds that block alone. With one activation row the B operand has 7 idle columns,
// so column j carries x only on the k-slots of quad thread j: C[row][j] is then the partial sum of thread j's k
// range, and threads 0 and 1 of each quad apply the scales of all four threads' blocks.
//
// Layout (like gemv.cu): one warp walks a 16-row tile; in each 64-byte chunk of a row (128 elements = one
// activation block) quad thread t owns bytes 16t..16t+15 = elements 32t..32t+31 as 4 words of 8 codes. Word i
// feeds one mma: its elements 0..3 are A slots 4t..4t+3, 4..7 slots 4t+16..4t+19. The block's shared memory holds
// x in e4m3 in element order, so the matching B words are one 8-byte load. NVFP4 words 0-1 and 2-3 are two
// 16-element scale blocks (two accumulator sets); MXFP4's 32-element block is the whole piece.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/dequant.cuh"
#include "cuda/gemv_launch.h"
#include "cuda/gemv_ring.cuh"
#include "cuda/gemv_slot.cuh"
#include "cuda/launch.cuh"
#include "formats/fp8.h"

namespace dsv4::detail {
namespace {

constexpr int kThreads = kGemvWarps * 32;
constexpr int kChunkBytes = 64;  // one row's bytes per chunk: 4 quad threads x 16 bytes
constexpr int kChunkK = 128;     // elements per chunk = the activation quantisation block
constexpr int kUnroll = 4;       // chunks loaded per thread before the first is used
constexpr float kBiasGap = 64.0f;  // the e4m3 bytes below hold e2m1 * 2^-6

// Eight e2m1 codes of one word in the device layout (fp4_layout.h) -> e4m3 bytes of elements 0..3 (lo) and 4..7
// (hi), each e2m1 * 2^-6: from the bf16 bit patterns of the GEMV decode (m e0 e1 at bits 6..8 of a half, the sign
// at 15), the magnitude moves to bits 10..12 (e4m3 bits 2..4 of the half's high byte: the two low exponent bits and
// the top mantissa bit) beside the sign, so e2m1's subnormal 0.5 lands on e4m3's subnormal 2^-7; a byte permute
// then gathers the high bytes.
__device__ __forceinline__ void e2m1x8_to_e4m3(uint32_t q, uint32_t& lo, uint32_t& hi) {
  uint32_t r[4];
  fp4_layout::raw_bf16x2(q, r);
#pragma unroll
  for (int p = 0; p < 4; ++p) r[p] = (r[p] << 4) | (r[p] & 0x80008000u);
  lo = dq::prmt(r[0], r[1], 0x7531);
  hi = dq::prmt(r[2], r[3], 0x7531);
}

__device__ __forceinline__ void mma_e4m3(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats -> e4m3 bytes (round to nearest even, saturating at +-448 like round_e4m3): lo in the low byte.
__device__ __forceinline__ uint32_t f32x2_to_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float e4m3_byte_to_f32(uint32_t b) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(b & 0xff), __NV_E4M3);
  return __half2float(__half(__half_raw{h.x}));
}

// One activation row -> xq (e4m3, zero past k) and xs (block scales):
// act_quant_fp8 of gemv.h, with the scale formula of src/formats (pow2_scale) and the same e4m3 rounding.
// Eight lanes share a block (16 elements each), so one pass of the block quantises 32 blocks with short chains:
// this runs before the block's first mma, and its latency is paid once per block.
__device__ void quantise_row(const uint16_t* x, int k, int n_chunks, uint8_t* xq, float* xs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  constexpr int kBlocksPerPass = kGemvWarps * 4;
  for (int b0 = 0; b0 < n_chunks; b0 += kBlocksPerPass) {
    const int b = b0 + warp * 4 + (lane >> 3);
    const int e0 = b * kChunkK + (lane & 7) * 16;  // k is a multiple of 32: 16 elements are all in or all out
    uint32_t w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    if (b < n_chunks && e0 < k) {
      const uint4* src = reinterpret_cast<const uint4*>(x + e0);
      const uint4 lo = src[0], hi = src[1];
      w[0] = lo.x, w[1] = lo.y, w[2] = lo.z, w[3] = lo.w, w[4] = hi.x, w[5] = hi.y, w[6] = hi.z, w[7] = hi.w;
    }
    float v[16];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[2 * i] = __uint_as_float(w[i] << 16), v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) amax = fmaxf(amax, fabsf(v[i]));
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (b >= n_chunks) continue;  // after the shuffles: whole 8-lane groups leave together
    const float s = pow2_scale(amax, kE4M3Max, 1e-4f);
    const float inv = 1.0f / s;  // a power of two: x * inv == x / s
    if ((lane & 7) == 0) xs[b] = s;
    uint32_t q[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      q[i] = f32x2_to_e4m3x2(v[4 * i] * inv, v[4 * i + 1] * inv) | f32x2_to_e4m3x2(v[4 * i + 2] * inv, v[4 * i + 3] * inv) << 16;
    *reinterpret_cast<uint4*>(xq + e0) = make_uint4(q[0], q[1], q[2], q[3]);
  }
}

// Chunk c (128 weights of rows g and g + 8 = activation block c) of the quad's pieces: raw codes, the scale bits of
// quad threads 2t and 2t + 1 (threads 0, 1; NVFP4: 4 e4m3 bytes, MXFP4: 2 e8m0 bytes), x in e4m3 in shared memory
// (xq, groups permuted, and its block scales xs). Adds the chunk's partial sums to acc_lo / acc_hi.
// B: column g carries x only on the slots of quad thread g (this thread's own slots when g == t).
template <bool kNv>
__device__ __forceinline__ void w4a8_chunk(const uint4& raw_lo, const uint4& raw_hi, uint32_t sc_lo, uint32_t sc_hi,
                                           const uint8_t* xq, const float* xs, int c, float& acc_lo, float& acc_hi) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint4 xv[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
  if (g == t) {
    const uint4* xp = reinterpret_cast<const uint4*>(xq + c * kChunkK + 32 * t);
    xv[0] = xp[0], xv[1] = xp[1];
  }
  const uint32_t xb[8] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w};
  const uint32_t wl[4] = {raw_lo.x, raw_lo.y, raw_lo.z, raw_lo.w};
  const uint32_t wh[4] = {raw_hi.x, raw_hi.y, raw_hi.z, raw_hi.w};
  float ca[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t lo_first, lo_second, hi_first, hi_second;  // rows g / g + 8, elements 0..3 / 4..7 of word i
    e2m1x8_to_e4m3(wl[i], lo_first, lo_second);
    e2m1x8_to_e4m3(wh[i], hi_first, hi_second);
    mma_e4m3(kNv && i >= 2 ? cb : ca, lo_first, hi_first, lo_second, hi_second, xb[2 * i], xb[2 * i + 1]);
  }
  // ca / cb [0], [1]: row lo, threads 2t / 2t+1; [2], [3]: row hi. Zero for t >= 2 (idle columns).
  float part_lo, part_hi;
  if constexpr (kNv) {  // bytes: 2t block A, 2t block B, 2t+1 block A, 2t+1 block B
    part_lo = ca[0] * e4m3_byte_to_f32(sc_lo) + cb[0] * e4m3_byte_to_f32(sc_lo >> 8) +
              ca[1] * e4m3_byte_to_f32(sc_lo >> 16) + cb[1] * e4m3_byte_to_f32(sc_lo >> 24);
    part_hi = ca[2] * e4m3_byte_to_f32(sc_hi) + cb[2] * e4m3_byte_to_f32(sc_hi >> 8) +
              ca[3] * e4m3_byte_to_f32(sc_hi >> 16) + cb[3] * e4m3_byte_to_f32(sc_hi >> 24);
  } else {  // bytes: the e8m0 scales of threads 2t, 2t+1
    part_lo = ca[0] * e8m0_to_f32(uint8_t(sc_lo)) + ca[1] * e8m0_to_f32(uint8_t(sc_lo >> 8));
    part_hi = ca[2] * e8m0_to_f32(uint8_t(sc_hi)) + ca[3] * e8m0_to_f32(uint8_t(sc_hi >> 8));
  }
  const float sx = xs[c];
  acc_lo = fmaf(part_lo, sx, acc_lo);
  acc_hi = fmaf(part_hi, sx, acc_hi);
}

// The end of one activation row of a W4A8 kernel: threads 0 and 1 of each quad add their partial sums, the warps of
// a tile are added in order through `red`, and the block's rows go to y row `out_row` (y_second for the second
// projection of a grouped launch).
__device__ __forceinline__ void store_w4a8_row(const KernelArgs& a, float (*red)[16], float acc_lo, float acc_hi,
                                               int tiles_per_block, int split, float y_factor, int64_t out_row,
                                               bool second) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  acc_lo += __shfl_xor_sync(0xffffffffu, acc_lo, 1);  // threads 0 + 1 of the quad (2 and 3 hold zeros)
  acc_hi += __shfl_xor_sync(0xffffffffu, acc_hi, 1);
  if (t == 0) {
    red[warp][g] = acc_lo;
    red[warp][g + 8] = acc_hi;
  }
  __syncthreads();
  const int rows_in_block = tiles_per_block * 16;
  const int r = threadIdx.x;
  const int n = blockIdx.x * rows_in_block + r;
  if (r < rows_in_block && n < a.n) {
    float s = 0.0f;
    for (int p = 0; p < split; ++p) s += red[(r / 16) * split + p][r % 16];
    s *= y_factor;
    void* y = second ? a.y_second : a.y;
    const int64_t out = out_row * a.ldy + n;
    if (a.out_bf16)
      static_cast<uint16_t*>(y)[out] = f32_to_bf16(s);
    else
      static_cast<float*>(y)[out] = s;
  }
}

template <bool kNv, bool kGrouped>
__global__ void __launch_bounds__(kThreads, 2) gemv_w4a8_kernel(const KernelArgs a) {
  gpu::dependent_enter();
  __shared__ __align__(16) uint8_t xq[kW4a8MaxK];
  __shared__ float xs[kW4a8MaxK / kChunkK];
  __shared__ float red[kGemvWarps][16];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int split = a.split, tiles_per_block = kGemvWarps / split;
  const int tile = warp / split, part = warp % split;
  const int row0 = (blockIdx.x * tiles_per_block + tile) * 16;
  const int r_lo = row0 + g, r_hi = row0 + g + 8;
  const bool ok_lo = r_lo < a.n, ok_hi = r_hi < a.n;
  const int n_chunks = (a.k + kChunkK - 1) / kChunkK;
  const size_t row_bytes = size_t(a.k) / 2, scale_ld = size_t(a.k) / (kNv ? 16 : 32);

  const uint8_t* w_base = a.w;
  const uint8_t* w_scale = a.w_scale;
  float y_factor = a.y_factor;
  int m_rows = a.m, order0 = 0;
  if constexpr (kGrouped) {
    GroupedSlot slot;
    if (!grouped_slot(a, slot)) return;  // the whole block, before any barrier
    w_base = slot.w;
    w_scale = slot.w_scale;
    y_factor = slot.y_factor;
    order0 = slot.order0;
    m_rows = slot.m_rows;
  }
  w_base += size_t(a.w_row0) * row_bytes;
  w_scale += size_t(a.w_row0) * scale_ld;
  const uint8_t* w_lo = w_base + size_t(r_lo) * row_bytes + t * 16;
  const uint8_t* w_hi = w_lo + 8 * row_bytes;
  // Threads 0 and 1 of a quad read the scales of threads 2t and 2t+1 (the columns they hold).
  const uint8_t* s_lo = w_scale + size_t(r_lo) * scale_ld + (kNv ? 4 : 2) * t;
  const uint8_t* s_hi = s_lo + 8 * scale_ld;
  auto pair_of = [&](int row) { return kGrouped ? a.row_order[order0 + row] : row; };

  // The weight stream of a group of kUnroll chunks: raw codes and (threads 0, 1 of each quad) the scale bytes of
  // quad threads 2t and 2t+1 (NVFP4: 4 e4m3 bytes; MXFP4: 2 e8m0 bytes). A block past k keeps zero weights and scale.
  uint4 raw_lo[kUnroll], raw_hi[kUnroll];
  uint32_t sc_lo[kUnroll], sc_hi[kUnroll];
  auto load_group = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * split;
      const bool in_k = c < n_chunks && c * kChunkK + t * 32 < a.k;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      raw_lo[u] = in_k && ok_lo ? dq::load_weights(w_lo + size_t(c) * kChunkBytes) : zero;
      raw_hi[u] = in_k && ok_hi ? dq::load_weights(w_hi + size_t(c) * kChunkBytes) : zero;
      sc_lo[u] = sc_hi[u] = 0;
      if (t < 2 && c < n_chunks) {
        // The scale bytes of threads 2t and 2t+1; a block past k holds zero weights (its scale stays 0).
        const int e_first = c * kChunkK + 64 * t;  // first element of thread 2t's piece
        if constexpr (kNv) {
          const size_t off = size_t(c) * 8;
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if (e_first + 32 * j < a.k) {
              const uint32_t lo = ok_lo ? __ldg(reinterpret_cast<const uint16_t*>(s_lo + off) + j) : 0;
              const uint32_t hi = ok_hi ? __ldg(reinterpret_cast<const uint16_t*>(s_hi + off) + j) : 0;
              sc_lo[u] |= lo << (16 * j);
              sc_hi[u] |= hi << (16 * j);
            }
        } else {
          const size_t off = size_t(c) * 4;
#pragma unroll
          for (int j = 0; j < 2; ++j)
            if (e_first + 32 * j < a.k) {
              sc_lo[u] |= uint32_t(ok_lo ? __ldg(s_lo + off + j) : 0) << (8 * j);
              sc_hi[u] |= uint32_t(ok_hi ? __ldg(s_hi + off + j) : 0) << (8 * j);
            }
        }
      }
    }
  };
  float acc_lo, acc_hi;
  auto compute_group = [&](int c0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * split;
      if (c >= n_chunks) break;  // warp-uniform: every lane joins each mma.sync
      w4a8_chunk<kNv>(raw_lo[u], raw_hi[u], sc_lo[u], sc_hi[u], xq, xs, c, acc_lo, acc_hi);
    }
  };

  for (int rb = 0; rb < m_rows; ++rb) {  // one row per plain call; a grouped slot may hold several
    if (rb > 0) __syncthreads();  // the previous row's reads of xq, xs and red are done
    const int step = split * kUnroll;
    // The first group's loads go out before x is quantised, so the DRAM stream starts at once.
    if (row0 < a.n) load_group(part);
    const int x_row = kGrouped ? pair_of(rb) / a.x_row_div : rb;
    quantise_row(a.x + size_t(x_row) * a.k, a.k, n_chunks, xq, xs);
    __syncthreads();
    acc_lo = acc_hi = 0.0f;
    if (row0 < a.n) {
      for (int c0 = part; c0 < n_chunks; c0 += step) {
        compute_group(c0);
        if (c0 + step < n_chunks) load_group(c0 + step);
      }
    }
    store_w4a8_row(a, red, acc_lo, acc_hi, tiles_per_block, split, y_factor, pair_of(rb), kGrouped && blockIdx.z == 1);
  }
}

// The same products with the weights through the copy engine (set_gemv_bulk; gemv_ring.cuh): each warp streams
// its tile's k range through a ring of 2 stages (4 chunks = 4 activation blocks each; 2 stages so that two blocks
// fit an SM next to x), issuing the first before x is quantised (a plain launch: before griddepcontrol.wait).
// Dynamic shared memory: the rings, their barriers, then xq [k] and xs [k / 128].
constexpr int kBulkStages = 2;
using BulkRing = WarpRing<kBulkStages>;
constexpr int kBulkRingBytes = kGemvWarps * BulkRing::kBytes;
constexpr int kBulkXAt = kBulkRingBytes + kGemvWarps * kBulkStages * int(sizeof(uint64_t));
constexpr int kBulkMaxSmem = kBulkXAt + kW4a8MaxK + kW4a8MaxK / kChunkK * int(sizeof(float));
static_assert(kBulkRingBytes % 16 == 0 && kBulkXAt % 16 == 0, "alignment");

template <bool kNv, bool kGrouped>
__global__ void __launch_bounds__(kThreads, 2) gemv_w4a8_bulk_kernel(const KernelArgs a) {
  gpu::allow_dependents();
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float red[kGemvWarps][16];
  uint8_t* xq = smem + kBulkXAt;
  float* xs = reinterpret_cast<float*>(xq + a.k);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int n_chunks = a.k / kChunkK;
  const WarpTile wt = warp_tile(a, n_chunks / kStageChunks);
  const int s_begin = wt.s_begin, my_stages = wt.stages;
  const bool ok_lo = g < wt.rows_valid, ok_hi = g + 8 < wt.rows_valid;
  const size_t row_bytes = size_t(a.k) / 2, scale_ld = size_t(a.k) / (kNv ? 16 : 32);

  BlockRows rows;
  if (!block_rows<kGrouped>(a, rows)) return;  // an empty slot: the whole block, before any barrier
  const BulkRing ring{smem + warp * BulkRing::kBytes,
                      reinterpret_cast<uint64_t*>(smem + kBulkRingBytes) + warp * kBulkStages,
                      rows.w + size_t(rows.w_row0 + wt.row0) * row_bytes,
                      rows.w_scale + size_t(rows.w_row0 + wt.row0) * scale_ld,
                      row_bytes, scale_ld, wt.rows_valid, s_begin, kNv ? 32 : 16, false};
  ring.init(lane);
  if constexpr (!kGrouped) {
    ring.start(0, my_stages, lane);
    gpu::dependent_wait();  // x and y belong to the step
  }

  int q0 = 0;  // stages this warp has used in earlier rows
  for (int rb = 0; rb < rows.m_rows; ++rb) {  // one row per plain call; a grouped slot may hold several
    if (rb > 0) {
      __syncthreads();  // the previous row's reads of xq, xs and red are done
      ring.start(q0, my_stages, lane);
    } else if constexpr (kGrouped) {
      ring.start(0, my_stages, lane);
    }
    const int x_row = kGrouped ? a.row_order[rows.order0 + rb] / a.x_row_div : rb;
    quantise_row(a.x + size_t(x_row) * a.k, a.k, n_chunks, xq, xs);
    __syncthreads();
    float acc_lo = 0.0f, acc_hi = 0.0f;
    for (int i = 0; i < my_stages; ++i) {
      const int q = q0 + i;
      const uint8_t* stage = ring.wait(q);
      const uint8_t* sc = stage + kScalesAt + g * kScaleRowBytes;
#pragma unroll
      for (int c = 0; c < kStageChunks; ++c) {
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint4 raw_lo = ok_lo ? lds128(stage + stage_row_at(g) + c * 64 + t * 16) : zero;
        const uint4 raw_hi = ok_hi ? lds128(stage + stage_row_at(g + 8) + c * 64 + t * 16) : zero;
        // Threads 0 and 1 of a quad: the scale bytes of quad threads 2t and 2t + 1 of chunk c.
        uint32_t sc_lo = 0, sc_hi = 0;
        if (t < 2) {
          if constexpr (kNv) {
            if (ok_lo) sc_lo = *reinterpret_cast<const uint32_t*>(sc + c * 8 + 4 * t);
            if (ok_hi) sc_hi = *reinterpret_cast<const uint32_t*>(sc + 8 * kScaleRowBytes + c * 8 + 4 * t);
          } else {
            if (ok_lo) sc_lo = *reinterpret_cast<const uint16_t*>(sc + c * 4 + 2 * t);
            if (ok_hi) sc_hi = *reinterpret_cast<const uint16_t*>(sc + 8 * kScaleRowBytes + c * 4 + 2 * t);
          }
        }
        w4a8_chunk<kNv>(raw_lo, raw_hi, sc_lo, sc_hi, xq, xs, (s_begin + i) * kStageChunks + c, acc_lo, acc_hi);
      }
      __syncwarp();  // every lane's reads of this slot are done before it is refilled
      if (i + kBulkStages < my_stages) ring.issue(i + kBulkStages, q + kBulkStages, lane);
    }
    q0 += my_stages;
    store_w4a8_row(a, red, acc_lo, acc_hi, wt.tiles_per_block, a.split, rows.y_factor,
                   kGrouped ? a.row_order[rows.order0 + rb] : rb, kGrouped && blockIdx.z == 1);
  }
}

// One warp per (row, 128-block): y = bf16(act_quant_fp8(x)), bit-identical to fp8_simulate_block on bf16 input.
__global__ void act_quant_kernel(const uint16_t* x, uint16_t* y, int rows, int k) {
  gpu::dependent_enter();
  const int lane = threadIdx.x & 31;
  const int blocks_per_row = (k + kChunkK - 1) / kChunkK;
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (item >= int64_t(rows) * blocks_per_row) return;
  const int64_t row = item / blocks_per_row;
  const int e0 = int(item % blocks_per_row) * kChunkK + lane * 4;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const bool in_k = e0 < k;  // k is a multiple of 8 here; the lane's 4 elements are checked one by one below
  for (int j = 0; j < 4; ++j)
    if (e0 + j < k) v[j] = bf16_to_f32(x[row * k + e0 + j]);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float s = pow2_scale(amax, kE4M3Max, 1e-4f);
  if (!in_k) return;
  for (int j = 0; j < 4; ++j)
    if (e0 + j < k) y[row * k + e0 + j] = f32_to_bf16(round_e4m3(v[j] / s) * s);
}

template <auto kKernel>
cudaError_t launch_bulk(const KernelArgs& a, dim3 grid, size_t smem, cudaStream_t stream) {
  if (const cudaError_t e = gpu::allow_dynamic_smem<kKernel>(kBulkMaxSmem); e != cudaSuccess) return e;
  gpu::launch(kKernel, grid, kThreads, smem, stream, a);
  return cudaGetLastError();
}

}  // namespace

bool gemv_w4a8_supported(const GemvParams& p) {
  return p.act == GemvAct::FP8 && (p.weight == GemvWeight::MXFP4 || p.weight == GemvWeight::NVFP4) && p.m == 1 &&
         p.layout == GemvLayout::Rows &&
         p.k <= kW4a8MaxK && gemv_w4a8_enabled();
}

bool gemv_w4a8_bulk_supported(const GemvParams& p) {
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return gemv_bulk_enabled() && gemv_w4a8_supported(p) && p.k % (kStageChunks * kChunkK) == 0 && aligned16(p.w) &&
         aligned16(p.w_scale);
}

cudaError_t gemv_w4a8_launch(const KernelArgs& args, const GemvParams& p, dim3 grid, bool grouped) {
  KernelArgs a = args;
  const bool nv = p.weight == GemvWeight::NVFP4;
  a.y_factor = (nv ? p.w_scale_2 : 1.0f) * kBiasGap;
  a.nvfp4_factor = nv ? kBiasGap : 0.0f;
  cudaStream_t stream = p.stream;
  grid.x = (a.n + kGemvWarps / a.split * 16 - 1) / (kGemvWarps / a.split * 16);
  auto aligned16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool bulk = gemv_w4a8_bulk_supported(p) &&
                    (!grouped || (a.w_stride % 16 == 0 && a.scale_stride % 16 == 0 &&
                                  (!a.w_second || (aligned16(a.w_second) && aligned16(a.w_scale_second)))));
  if (bulk) {
    const size_t smem = size_t(kBulkXAt) + size_t(p.k) + size_t(p.k / kChunkK) * sizeof(float);
    if (nv) return grouped ? launch_bulk<gemv_w4a8_bulk_kernel<true, true>>(a, grid, smem, stream)
                           : launch_bulk<gemv_w4a8_bulk_kernel<true, false>>(a, grid, smem, stream);
    return grouped ? launch_bulk<gemv_w4a8_bulk_kernel<false, true>>(a, grid, smem, stream)
                   : launch_bulk<gemv_w4a8_bulk_kernel<false, false>>(a, grid, smem, stream);
  }
  if (nv && grouped) gpu::launch(gemv_w4a8_kernel<true, true>, grid, kThreads, 0, stream, a);
  else if (nv) gpu::launch(gemv_w4a8_kernel<true, false>, grid, kThreads, 0, stream, a);
  else if (grouped) gpu::launch(gemv_w4a8_kernel<false, true>, grid, kThreads, 0, stream, a);
  else gpu::launch(gemv_w4a8_kernel<false, false>, grid, kThreads, 0, stream, a);
  return cudaGetLastError();
}

cudaError_t act_quant_launch(const uint16_t* x, uint16_t* y, int rows, int k, cudaStream_t stream) {
  const int64_t items = int64_t(rows) * ((k + kChunkK - 1) / kChunkK);
  constexpr int kWarpsPerBlock = 8;
  if (items == 0) return cudaSuccess;
  gpu::launch(act_quant_kernel, unsigned((items + kWarpsPerBlock - 1) / kWarpsPerBlock), kWarpsPerBlock * 32, 0,
              stream, x, y, rows, k);
  return cudaGetLastError();
}

}  // namespace dsv4::detail
