// SPDX-License-Identifier: MIT
// Row-wise kernels of the forward pass: norm / RoPE / storage rounding, small fp32 linears, embedding and the
// mHC pre / post / head mixes. Where the CPU reference's result depends on the order of fp32 operations
// (RoPE, the mHC mixes and collapse, Sinkhorn) the products and sums are written with explicit _rn intrinsics,
// so nvcc does not contract them into FMAs and the GPU rounds exactly like the CPU.
//
// A decode step calls these with one token, so they are latency-bound: each kernel keeps every thread's global
// loads independent (issued together, one round trip), spreads a row over as many threads as it has 4-value
// groups, and reduces with shuffles and one block_sum instead of serial per-thread loops.
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "cuda/device.h"
#include "cuda/launch.cuh"
#include "cuda/linear_f32.cuh"
#include "cuda/mma.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"
#include "formats/fp4.h"
#include "formats/fp8.h"

namespace dsv4::gpu {
namespace {

namespace cg = cooperative_groups;

using detail::block_sum;
using detail::dot_acc;
using detail::kLinearThreads;
using detail::blocks_for;
using detail::sigmoid;
using ::dsv4::detail::cp_async_16;
using ::dsv4::detail::cp_async_commit;
using ::dsv4::detail::cp_async_wait;

constexpr int kMaxHc = 8;

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

__device__ __forceinline__ bool aligned_dev(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Four consecutive values row[d..d+3] (zeros past `count`); `vec`: one 16-byte load (caller checked alignment
// and count % 4 == 0).
__device__ __forceinline__ float4 load4(const float* row, int d, int count, bool vec) {
  if (vec) return *reinterpret_cast<const float4*>(row + d);
  return make_float4(d < count ? row[d] : 0.0f, d + 1 < count ? row[d + 1] : 0.0f, d + 2 < count ? row[d + 2] : 0.0f,
                     d + 3 < count ? row[d + 3] : 0.0f);
}

__device__ __forceinline__ void store4(float* row, int d, int count, bool vec, float4 v) {
  if (vec) {
    *reinterpret_cast<float4*>(row + d) = v;
    return;
  }
  if (d < count) row[d] = v.x;
  if (d + 1 < count) row[d + 1] = v.y;
  if (d + 2 < count) row[d + 2] = v.z;
  if (d + 3 < count) row[d + 3] = v.w;
}

// bf16 of four consecutive values; `vec`: one 8-byte store.
__device__ __forceinline__ void store4_bf16(uint16_t* row, int d, int count, bool vec, float4 v) {
  const uint16_t b0 = f32_to_bf16(v.x), b1 = f32_to_bf16(v.y), b2 = f32_to_bf16(v.z), b3 = f32_to_bf16(v.w);
  if (vec) {
    *reinterpret_cast<uint2*>(row + d) = make_uint2(b0 | uint32_t(b1) << 16, b2 | uint32_t(b3) << 16);
    return;
  }
  if (d < count) row[d] = b0;
  if (d + 1 < count) row[d + 1] = b1;
  if (d + 2 < count) row[d + 2] = b2;
  if (d + 3 < count) row[d + 3] = b3;
}

// ---- row_op ---------------------------------------------------------------------------------------------------
// Thread g of a row owns the four values first + 0..3, first = 4g - shift (shift = 1 when dim - rope_dim is odd,
// so that RoPE pairs never straddle two threads). A row of T = ceil((dim + shift) / 4) threads takes
// `lanes` = the next power of two (T <= 32: several rows share a warp, reductions are shuffles within the row's
// lane group) or all threads of its own block (T > 32: lanes = blockDim, block_sum). FP8 blocks of 64 values are
// then 16 aligned lanes and FP4 blocks of 32 are 8: amax by shuffles, each lane rounds its own values with the
// src/formats functions, so the result is bit-identical to fp8_simulate_block / fp4_simulate_block.

constexpr int kRowValues = 4;  // values per thread

__device__ __forceinline__ double row_sum(double v, int lanes) {
  if (lanes > 32) return block_sum(v);
  for (int o = lanes / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;  // xor butterflies add commutatively: every lane of the group holds the same bits
}

// Max over aligned groups of `lanes` (power of two <= 32) lanes; fmax is exact, so the order does not matter.
__device__ __forceinline__ float group_max(float v, int lanes) {
  for (int o = lanes / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block `block` of one row op (row_op_kernel: blockIdx.x; row_op_pair_kernel: the op's own block index).
__device__ __forceinline__ void row_op_block(const RowOpParams& p, int lanes, int rows_per_block, int block) {
  extern __shared__ float exchange[];  // [dim]: Hadamard stages across warps (IndexerFp4, dim > 128)
  const int rows = p.tokens * p.heads;
  const int g = threadIdx.x % lanes, row_raw = block * rows_per_block + threadIdx.x / lanes;
  // Rows past the end (a partly filled last block) redo the last row without storing it: every lane must reach
  // the shuffles and barriers.
  const bool live = row_raw < rows;
  const int r = live ? row_raw : rows - 1, t = r / p.heads, h = r % p.heads;
  int64_t pos0 = p.pos_device ? *p.pos_device : p.pos0, entry = 0;
  const float* x_base = p.x;
  float* y_base = p.y;
  int tt = t;  // token index into the strides
  if (p.emit_ratio > 0) {  // decode step of a captured graph: finish entry pos / r only if this step completes it
    if (p.rows_base) {  // batched: row t is its own sequence's entry array (one row per block)
      pos0 = p.pos_rows[t];
      x_base = y_base = p.rows_base[t];
      tt = 0;
    }
    if ((pos0 + 1) % p.emit_ratio != 0) return;  // uniform over the block (one row)
    entry = pos0 / p.emit_ratio;
    pos0 = entry * p.emit_ratio;
  }
  const int dim = p.dim, nope = dim - p.rope_dim, half_rope = p.rope_dim / 2;
  const int first = kRowValues * g - (p.rope_dim > 0 ? (nope & 1) : 0);
  const bool full = first >= 0 && first + 3 < dim;  // all four values inside the row
  const float* x = x_base + (tt + entry) * p.x_token_stride + h * p.x_head_stride;

  float v[kRowValues];
  if (full && aligned_dev(x + first, 16)) {
    const float4 q = *reinterpret_cast<const float4*>(x + first);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  } else {
#pragma unroll
    for (int j = 0; j < kRowValues; ++j) {
      const int i = first + j;
      v[j] = i >= 0 && i < dim ? x[i] : 0.0f;
    }
  }
  float weight[kRowValues];
#pragma unroll
  for (int j = 0; j < kRowValues; ++j) {
    const int i = first + j;
    weight[j] = p.norm && p.weight && i >= 0 && i < dim ? p.weight[i] : 1.0f;
  }
  // RoPE angles (fp32 like the reference, cos / sin in fp64 then rounded) do not depend on the data: computed
  // while the loads and the norm's reduction are in flight.
  float cos_a[2], sin_a[2];
  bool rotate[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int pair = (first + 2 * k - nope) / 2;  // first - nope is even by the choice of shift
    rotate[k] = first + 2 * k >= nope && pair < half_rope;
    cos_a[k] = 1.0f, sin_a[k] = 0.0f;
    if (rotate[k]) {
      const int64_t position = p.pos_rows && !p.rows_base ? p.pos_rows[t] : pos0 + int64_t(tt) * p.pos_step;
      const float angle = __fmul_rn(float(position), p.inv_freq[pair]);
      double s, c;
      sincos(double(angle), &s, &c);
      cos_a[k] = float(c);
      sin_a[k] = p.inverse ? -float(s) : float(s);
    }
  }

  if (p.norm) {
    double ss = 0;
#pragma unroll
    for (int j = 0; j < kRowValues; ++j) ss += double(v[j]) * v[j];  // values outside the row are 0
    ss = row_sum(ss, lanes);
    const float inv_rms = 1.0f / sqrtf(float(ss / dim) + p.eps);
#pragma unroll
    for (int j = 0; j < kRowValues; ++j) v[j] = __fmul_rn(__fmul_rn(v[j], inv_rms), weight[j]);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (rotate[k]) {
      const float a = v[2 * k], b = v[2 * k + 1];
      v[2 * k] = __fsub_rn(__fmul_rn(a, cos_a[k]), __fmul_rn(b, sin_a[k]));
      v[2 * k + 1] = __fadd_rn(__fmul_rn(a, sin_a[k]), __fmul_rn(b, cos_a[k]));
    }

  switch (p.round) {
    case RowRound::None: break;
    case RowRound::Bf16:
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) v[j] = round_bf16(v[j]);
      break;
    case RowRound::KvFp8: {
      // nope % 64 == 0, so shift is 0 and a thread's four values are all nope (one FP8 block) or all RoPE.
      const bool in_nope = first < nope;
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) amax = in_nope ? fmaxf(amax, fabsf(v[j])) : amax;
      amax = group_max(amax, 64 / kRowValues);
      if (in_nope) {
        const float s = pow2_scale(amax, kE4M3Max, 1e-4f);
#pragma unroll
        for (int j = 0; j < kRowValues; ++j) v[j] = round_e4m3(v[j] / s) * s;
      } else {
#pragma unroll
        for (int j = 0; j < kRowValues; ++j) v[j] = round_bf16(v[j]);
      }
      break;
    }
    case RowRound::IndexerFp4: {
      // Sylvester-order butterflies (a, b) -> (a + b, a - b) on pairs (i, i + half), half = 1, 2, 4, ..: the
      // same sums as cpu::hadamard_transform. dim is a power of two, shift 0, T = dim / 4 threads exactly.
      float a = v[0], b = v[1];
      v[0] = a + b, v[1] = a - b;
      a = v[2], b = v[3];
      v[2] = a + b, v[3] = a - b;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        a = v[j], b = v[j + 2];
        v[j] = a + b, v[j + 2] = a - b;
      }
      for (int half = kRowValues; half < dim; half *= 2) {  // partner value in thread g ^ (half / 4)
        const int lane_bit = half / kRowValues;
        const bool upper = (g & lane_bit) != 0;
        float other[kRowValues];
        if (lane_bit < 32) {
#pragma unroll
          for (int j = 0; j < kRowValues; ++j) other[j] = __shfl_xor_sync(0xffffffffu, v[j], lane_bit);
        } else {  // across warps (one row per block here)
          __syncthreads();  // the previous stage's reads are done
#pragma unroll
          for (int j = 0; j < kRowValues; ++j) exchange[first + j] = v[j];
          __syncthreads();
#pragma unroll
          for (int j = 0; j < kRowValues; ++j) other[j] = exchange[(first ^ half) + j];
        }
#pragma unroll
        for (int j = 0; j < kRowValues; ++j) v[j] = upper ? other[j] - v[j] : v[j] + other[j];
      }
      const float scale = 1.0f / sqrtf(float(dim));
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) v[j] *= scale;
      float amax = 0.0f;
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) amax = fmaxf(amax, fabsf(v[j]));
      amax = group_max(amax, 32 / kRowValues);
      const float s = pow2_scale(amax, kE2M1Max, kE2M1Max * 1.1754943508222875e-38f);
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) v[j] = round_e2m1(v[j] / s) * s;
      break;
    }
  }

  if (!live) return;
  const float4 out = make_float4(v[0], v[1], v[2], v[3]);
  if (y_base) {
    float* y = y_base + (tt + entry) * p.y_token_stride + h * p.y_head_stride;
    if (full && aligned_dev(y + first, 16)) {
      *reinterpret_cast<float4*>(y + first) = out;
    } else {
#pragma unroll
      for (int j = 0; j < kRowValues; ++j)
        if (first + j >= 0 && first + j < dim) y[first + j] = v[j];
    }
  }
  if (p.y_bf16) {
    uint16_t* yb = p.y_bf16 + int64_t(r) * dim;
    if (full && aligned_dev(yb + first, 8)) {
      store4_bf16(yb, first, dim, true, out);
    } else {
#pragma unroll
      for (int j = 0; j < kRowValues; ++j)
        if (first + j >= 0 && first + j < dim) yb[first + j] = f32_to_bf16(v[j]);
    }
  }
}

__global__ void row_op_kernel(__grid_constant__ const RowOpParams p, int lanes, int rows_per_block) {
  gpu::dependent_enter();
  row_op_block(p, lanes, rows_per_block, blockIdx.x);
}

// Two independent row ops in one launch: blocks [0, blocks_a) run a, the rest b, each op with its own lanes per row
// and rows per block (RowShape).
struct RowShape {
  int lanes, rows_per_block;
};
__global__ void row_op_pair_kernel(__grid_constant__ const RowOpParams a, __grid_constant__ const RowOpParams b,
                                   int blocks_a, RowShape shape_a, RowShape shape_b) {
  gpu::dependent_enter();
  if (int(blockIdx.x) < blocks_a)
    row_op_block(a, shape_a.lanes, shape_a.rows_per_block, blockIdx.x);
  else
    row_op_block(b, shape_b.lanes, shape_b.rows_per_block, blockIdx.x - blocks_a);
}

// ---- linear_f32 (the block: cuda/linear_f32.cuh) -----------------------------------------------------------------

template <int kRows, int kVec, bool kCluster>
__global__ void __launch_bounds__(kLinearThreads) linear_f32_kernel(LinearF32Params p, int slices, bool early) {
  detail::linear_f32_block<kRows, kVec, kCluster>(p, slices, early);
}

template <int kRows, int kVec>
void launch_linear_f32(const LinearF32Params& p, int slices, cudaStream_t stream) {
  const dim3 grid(unsigned(p.n) * slices, unsigned((p.m + kRows - 1) / kRows));
  if (slices == 1) {
    gpu::launch(linear_f32_kernel<kRows, kVec, false>, grid, kLinearThreads, 0, stream, p, 1,
                gpu::early_other_weights());
    DSV4_CUDA_LAUNCHED();
    return;
  }
  const cudaError_t err =
      gpu::launch_ex(linear_f32_kernel<kRows, kVec, true>, grid, kLinearThreads, 0, unsigned(slices), stream, p,
                     slices, gpu::early_other_weights());
  DSV4_CUDA_LAUNCHED();  // throws (and clears) a recorded launch error
  OPS_CHECK(err == cudaSuccess, "linear_f32: cluster launch failed: %s", cudaGetErrorString(err));
}

// Prefill chunks (m >= kLinearTallRows): the kernel above re-reads the 4 rows of x once per output column (the mHC
// mix: 24 x 32 MB from L2 per chunk of 512). Here block (row group, column group) keeps all kCols outputs of its
// kTallRows rows in registers: each thread walks its share of k once, loading the x rows and the kCols weight rows
// at each step, then the block sums the partials (warp trees, then the 8 warps in order: deterministic).
constexpr int kLinearTallRows = 64;  // m from which linear_f32_tall_kernel runs
constexpr int kTallRows = 4;

template <int kCols>
__global__ void __launch_bounds__(kLinearThreads) linear_f32_tall_kernel(LinearF32Params p) {
  gpu::dependent_enter();
  __shared__ float partial[kLinearThreads / 32][kTallRows][kCols];
  const int row0 = blockIdx.x * kTallRows, col0 = blockIdx.y * kCols, cols = min(kCols, p.n - col0);
  const int units = p.k / 4;
  const float4* x[kTallRows];
#pragma unroll
  for (int r = 0; r < kTallRows; ++r)  // rows past m re-read row m - 1 (never stored)
    x[r] = reinterpret_cast<const float4*>(p.x + int64_t(min(row0 + r, p.m - 1)) * p.k);
  const float4* w = reinterpret_cast<const float4*>(p.w + int64_t(col0) * p.k);
  float acc[kTallRows][kCols];
#pragma unroll
  for (int r = 0; r < kTallRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0f;
  for (int u = threadIdx.x; u < units; u += kLinearThreads) {
    float4 xv[kTallRows];
#pragma unroll
    for (int r = 0; r < kTallRows; ++r) xv[r] = x[r][u];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float4 wv = c < cols ? w[int64_t(c) * units + u] : float4{};
#pragma unroll
      for (int r = 0; r < kTallRows; ++r) acc[r][c] = dot_acc(xv[r], wv, acc[r][c]);
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kTallRows; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float v = detail::warp_sum(acc[r][c]);
      if (lane == 0) partial[warp][r][c] = v;
    }
  __syncthreads();
  for (int i = threadIdx.x; i < kTallRows * kCols; i += kLinearThreads) {
    const int r = i / kCols, c = i % kCols;
    if (row0 + r >= p.m || c >= cols) continue;
    float total = 0.0f;
    for (int wp = 0; wp < kLinearThreads / 32; ++wp) total += partial[wp][r][c];
    p.y[int64_t(row0 + r) * p.n + col0 + c] = total * p.scale;
  }
}

// Columns per block: the n of the mHC mixes (24) and of small routers / weight projections in one group.
template <int kCols>
void launch_linear_f32_tall(const LinearF32Params& p, cudaStream_t stream) {
  const dim3 grid(unsigned((p.m + kTallRows - 1) / kTallRows), unsigned((p.n + kCols - 1) / kCols));
  gpu::launch(linear_f32_tall_kernel<kCols>, grid, kLinearThreads, 0, stream, p);
  DSV4_CUDA_LAUNCHED();
}

// The same chunks as an fp32 GEMM tile (set_linear_f32_tiles). Block (column group of kCols, k-slice, 32-row group)
// streams its slice of k in 64-float chunks through a cp.async ring (x rows and W rows of the chunk, no registers
// held by the copies); warp w multiplies the chunk's floats [8w, 8w + 8) and lane (rq = lane / 4, cp = lane % 4)
// keeps rows rq + 8i (i < 4) x columns cp + 4j (j < kCols / 4) of partial sums in registers: for each i (j) the
// lanes read 8 (4) consecutive staged rows, which the padded stride puts in different bank groups. The 8 warps'
// partials are added in warp order through shared memory, and the kTileSlices blocks of a cluster (the k-slices) in
// rank order through distributed shared memory: deterministic without atomics or scratch. x is read once per column
// group and W once per 32 rows (the 4-row blocks above re-read W from L2 for every 4 rows: 40 µs for a 512-token mHC
// mix).
constexpr int kTileRows = 32;        // rows per block: 8 row quads
constexpr int kTileSlices = 8;       // k-slices per cluster (the portable cluster size)
constexpr int kTileChunk = 64;       // floats of k per stage: 8 per warp
constexpr int kTileStride = kTileChunk + 4;  // floats per staged row: a quarter warp's 16-byte reads of 8 rows hit
                                             // 8 different bank groups
constexpr int kTileStages = 4;
constexpr int kTileWarps = kLinearThreads / 32;
static_assert(kTileChunk == 8 * kTileWarps && kTileRows == 4 * 8, "warp w: floats 8w..8w+7; lane: 4 of 32 rows");
static_assert(kTileStride % 32 == 4, "consecutive staged rows start 4 banks apart");

template <int kCols>
constexpr size_t tile_smem_bytes() {
  const size_t ring = sizeof(float) * kTileStages * (kTileRows + kCols) * kTileStride;
  const size_t partials = sizeof(float) * (kTileWarps + 1) * kTileRows * kCols;  // the warps' and the block's sums
  return ring > partials ? ring : partials;
}

template <int kCols>
__global__ void __launch_bounds__(kLinearThreads) linear_f32_tile_kernel(LinearF32Params p) {
  constexpr int kLaneCols = kCols / 4;
  static_assert(kCols % 4 == 0, "columns split over the 4 lanes of a row quad");
  extern __shared__ float4 tile_smem[];
  float* ring = reinterpret_cast<float*>(tile_smem);  // [stage][kTileRows + kCols][kTileStride]: x rows, then W rows
  cg::cluster_group cluster = cg::this_cluster();
  const int slice = int(cluster.block_rank()), col0 = int(blockIdx.x / kTileSlices) * kCols;
  const int row0 = blockIdx.y * kTileRows, cols = min(kCols, p.n - col0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rq = lane >> 2, cp = lane & 3;
  // The slice: whole chunks, the last one of k zero-filled past k (k % 4 == 0: copies of 4 floats).
  const int chunks_total = (p.k + kTileChunk - 1) / kTileChunk;
  const int per_slice = (chunks_total + kTileSlices - 1) / kTileSlices;
  const int chunk0 = slice * per_slice, n_chunks = max(0, min(chunks_total, chunk0 + per_slice) - chunk0);
  gpu::dependent_enter();

  auto issue = [&](int c) {  // chunk c of the slice into its stage; rows past m / columns past n repeat the last
    float* stage = ring + (c % kTileStages) * (kTileRows + kCols) * kTileStride;
    const int k0 = (chunk0 + c) * kTileChunk;
    for (int i = threadIdx.x; i < (kTileRows + kCols) * (kTileChunk / 4); i += kLinearThreads) {
      const int r = i / (kTileChunk / 4), k = k0 + 4 * (i % (kTileChunk / 4));
      const float* src = r < kTileRows ? p.x + int64_t(min(row0 + r, p.m - 1)) * p.k
                                       : p.w + int64_t(col0 + min(r - kTileRows, cols - 1)) * p.k;
      const bool valid = k < p.k;
      cp_async_16(stage + r * kTileStride + 4 * (i % (kTileChunk / 4)), valid ? src + k : src, valid);
    }
  };
#pragma unroll
  for (int c = 0; c < kTileStages - 1; ++c) {
    if (c < n_chunks) issue(c);
    cp_async_commit();  // empty groups keep the wait counts uniform
  }
  float acc[4][kLaneCols] = {};
  for (int c = 0; c < n_chunks; ++c) {
    cp_async_wait<kTileStages - 2>();
    __syncthreads();  // chunk c has landed for every thread; chunk c - 1's stage is free again
    if (c + kTileStages - 1 < n_chunks) issue(c + kTileStages - 1);
    cp_async_commit();
    const float* stage = ring + (c % kTileStages) * (kTileRows + kCols) * kTileStride + 8 * warp;
    float4 xv[4][2];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        xv[r][h] = *reinterpret_cast<const float4*>(stage + (rq + 8 * r) * kTileStride + 4 * h);
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j) {
      const float* wr = stage + (kTileRows + cp + 4 * j) * kTileStride;
      const float4 w0 = *reinterpret_cast<const float4*>(wr), w1 = *reinterpret_cast<const float4*>(wr + 4);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[r][j] = dot_acc(xv[r][1], w1, dot_acc(xv[r][0], w0, acc[r][j]));
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the ring becomes the partial sums
  float* warp_sums = ring;                                // [warp][kTileRows][kCols]
  float* block_sums = ring + kTileWarps * kTileRows * kCols;  // [kTileRows][kCols]
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int j = 0; j < kLaneCols; ++j)
      warp_sums[(warp * kTileRows + rq + 8 * r) * kCols + cp + 4 * j] = acc[r][j];
  __syncthreads();
  for (int i = threadIdx.x; i < kTileRows * kCols; i += kLinearThreads) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kTileWarps; ++w) sum += warp_sums[w * kTileRows * kCols + i];
    block_sums[i] = sum;
  }
  cluster.sync();  // every slice's block sums are in its shared memory
  if (slice == 0)
    for (int i = threadIdx.x; i < kTileRows * kCols; i += kLinearThreads) {
      const int r = i / kCols, c = i % kCols;
      if (row0 + r >= p.m || c >= cols) continue;
      float total = 0.0f;
      for (int s = 0; s < kTileSlices; ++s) total += cluster.map_shared_rank(block_sums, s)[i];
      p.y[int64_t(row0 + r) * p.n + col0 + c] = total * p.scale;
    }
  cluster.sync();  // the block sums must outlive rank 0's reads
}

// Columns per block: the n of the mHC mixes (24) and of small routers / weight projections in one group.
template <int kCols>
void launch_linear_f32_tiles(const LinearF32Params& p, cudaStream_t stream) {
  constexpr auto kKernel = linear_f32_tile_kernel<kCols>;
  constexpr int kSmem = int(tile_smem_bytes<kCols>());
  const cudaError_t attr = gpu::allow_dynamic_smem<kKernel>(kSmem);
  OPS_CHECK(attr == cudaSuccess, "linear_f32: cannot allow %d bytes of shared memory", kSmem);
  const int col_groups = (p.n + kCols - 1) / kCols, row_groups = (p.m + kTileRows - 1) / kTileRows;
  OPS_CHECK(row_groups <= 65535, "linear_f32: m = %d rows exceed one grid", p.m);
  const cudaError_t err = gpu::launch_ex(kKernel, dim3(unsigned(col_groups) * kTileSlices, unsigned(row_groups)),
                                         kLinearThreads, size_t(kSmem), unsigned(kTileSlices), stream, p);
  DSV4_CUDA_LAUNCHED();  // throws (and clears) a recorded launch error
  OPS_CHECK(err == cudaSuccess, "linear_f32: cluster launch failed: %s", cudaGetErrorString(err));
}

// Prefill-sized calls: the 4-row blocks, or the cluster tiles under set_linear_f32_tiles.
template <int kCols>
void launch_linear_f32_prefill(const LinearF32Params& p, cudaStream_t stream) {
  if (linear_f32_tiles())
    launch_linear_f32_tiles<kCols>(p, stream);
  else
    launch_linear_f32_tall<kCols>(p, stream);
}

// ---- mHC ---------------------------------------------------------------------------------------------------------
// One block per token (hc_pre: two, see hc_pre_kernel); thread i owns the column groups d = 4i, 4i + 4·blockDim, ..
// of all hc streams. kHc is the register array bound (4 covers the models; 8 the contract's limit).

// The collapsed row lives in dynamic shared memory: 47 KB at most, + ~0.5 KB static, under the 48 KB a launch
// gets without opting in.
constexpr int kHcMaxD = 12032;
constexpr int kHcMixMax = 24;  // (2 + hc) · hc mix outputs for hc = 4: hc_post_mix's accumulators

constexpr int hc_max_threads(int hc_bound) { return hc_bound <= 4 ? 1024 : 512; }

// Σ of squares (fp64, like the reference) of a token's hc·D stream values over the block; every thread gets it.
template <int kHc>
__device__ double streams_sum_sq(const float* xs, int hc, int D, bool vec) {
  double ss = 0;
  for (int d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
    float4 v[kHc];
#pragma unroll
    for (int k = 0; k < kHc; ++k) v[k] = k < hc ? load4(xs + int64_t(k) * D, d, D, vec) : make_float4(0, 0, 0, 0);
#pragma unroll
    for (int k = 0; k < kHc; ++k) {
      ss += double(v[k].x) * v[k].x;
      ss += double(v[k].y) * v[k].y;
      ss += double(v[k].z) * v[k].z;
      ss += double(v[k].w) * v[k].w;
    }
  }
  return block_sum(ss);
}

// rs = (mean of streams² + eps)^-½ over the hc·D values (spec 2.3: one RMS for all streams).
__device__ __forceinline__ float streams_inv_rms(double ss, int width, float eps) {
  return 1.0f / sqrtf(float(ss / width) + eps);
}

// σ(mix · rs · scale + base), rounded like the reference's fp32 expression.
__device__ __forceinline__ float mix_gate(float mix, float rs, float scale, float base) {
  return sigmoid(__fadd_rn(__fmul_rn(__fmul_rn(mix, rs), scale), base));
}

// Mix output m of token t from hc_post_mix's per-block partials (HcPreParams::mix_partials), added in block order.
__device__ __forceinline__ float summed_mix_partials(const HcPreParams& p, int64_t t, int m, int n_mix) {
  const float* part = p.mix_partials + (t * n_mix + m) * p.mix_blocks;
  float sum = 0.0f;
  for (int b = 0; b < p.mix_blocks; ++b) sum += part[b];
  return sum;
}

// Per column group of four: the collapse Σ_k pre_k · v_k (streams k < hc, in order, rounded like the reference's
// fp32 expression), the fp64 sum of squares, and the normalised output acc · inv_rms · w.
template <int kHc>
__device__ __forceinline__ float4 collapse4(const float (&pre)[kHc], const float4 (&v)[kHc], int hc) {
  float4 acc = make_float4(0, 0, 0, 0);
#pragma unroll
  for (int k = 0; k < kHc; ++k)
    if (k < hc) {
      acc.x = __fadd_rn(acc.x, __fmul_rn(pre[k], v[k].x));
      acc.y = __fadd_rn(acc.y, __fmul_rn(pre[k], v[k].y));
      acc.z = __fadd_rn(acc.z, __fmul_rn(pre[k], v[k].z));
      acc.w = __fadd_rn(acc.w, __fmul_rn(pre[k], v[k].w));
    }
  return acc;
}
__device__ __forceinline__ double sum_sq4(float4 v) {
  double ss = double(v.x) * v.x;
  ss += double(v.y) * v.y;
  ss += double(v.z) * v.z;
  return ss + double(v.w) * v.w;
}
__device__ __forceinline__ float4 norm4(float4 acc, float inv_rms, float4 w) {
  return make_float4(__fmul_rn(__fmul_rn(acc.x, inv_rms), w.x), __fmul_rn(__fmul_rn(acc.y, inv_rms), w.y),
                     __fmul_rn(__fmul_rn(acc.z, inv_rms), w.z), __fmul_rn(__fmul_rn(acc.w, inv_rms), w.w));
}

// The collapse y = Σ_k pre_k · streams_k (pre_k = σ(mix_k·rs·scale[0] + base_k) + hc_eps), then
// rms_norm(y, weight) into normed fp32 and/or bf16 (either may be nullptr). y_smem: [D rounded up to 4], each
// thread reads back only the groups it wrote, so it needs no barrier.
template <int kHc>
__device__ void collapse_and_norm(const float* xs, int hc, int D, const float* mix, const float* base,
                                  const float* scale, float hc_eps, const float* weight, float eps, float* normed,
                                  uint16_t* normed_bf16, float* y_smem) {
  const bool vec = D % 4 == 0 && aligned_dev(xs, 16);
  // Loads that do not depend on rs go out before its reduction.
  float pre_mix[kHc], pre_base[kHc];
#pragma unroll
  for (int k = 0; k < kHc; ++k) {
    pre_mix[k] = k < hc ? mix[k] : 0.0f;
    pre_base[k] = k < hc ? base[k] : 0.0f;
  }
  const float scale0 = scale[0];
  const bool vec_w = D % 4 == 0 && aligned_dev(weight, 16);
  const float4 weight_first = load4(weight, 4 * threadIdx.x, D, vec_w && 4 * int(threadIdx.x) < D);

  const float rs = streams_inv_rms(streams_sum_sq<kHc>(xs, hc, D, vec), hc * D, eps);
  float pre[kHc];
#pragma unroll
  for (int k = 0; k < kHc; ++k) pre[k] = __fadd_rn(mix_gate(pre_mix[k], rs, scale0, pre_base[k]), hc_eps);

  double ss = 0;
  for (int d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
    float4 v[kHc];  // L1 hits: streams_sum_sq just read them
#pragma unroll
    for (int k = 0; k < kHc; ++k) v[k] = k < hc ? load4(xs + int64_t(k) * D, d, D, vec) : make_float4(0, 0, 0, 0);
    const float4 acc = collapse4<kHc>(pre, v, hc);
    *reinterpret_cast<float4*>(y_smem + d) = acc;  // zeros past D add nothing below
    ss += sum_sq4(acc);
  }
  ss = block_sum(ss);
  const float inv_rms = 1.0f / sqrtf(float(ss / D) + eps);
  const bool vec_out = D % 4 == 0 && (!normed || aligned_dev(normed, 16));
  const bool vec_bf16 = D % 4 == 0 && (!normed_bf16 || aligned_dev(normed_bf16, 8));
  for (int d = 4 * threadIdx.x; d < D; d += 4 * blockDim.x) {
    const float4 acc = *reinterpret_cast<const float4*>(y_smem + d);
    const float4 out = norm4(acc, inv_rms, d == 4 * int(threadIdx.x) ? weight_first : load4(weight, d, D, vec_w));
    if (normed) store4(normed, d, D, vec_out, out);
    if (normed_bf16) store4_bf16(normed_bf16, d, D, vec_bf16, out);
  }
}

// post and comb of one token on warp 0 (lane l owns cells l and l + 32 of the hc × hc matrix: row e / hc,
// column e % hc). Every row or column sum is added in index order by each lane of that row / column, exactly
// like the sequential reference, and the cells are exchanged through shared memory between the steps.
__device__ void post_and_comb(const HcPreParams& p, int t, float rs, const float (&comb_mix)[2],
                              const float (&comb_base)[2], float post_mix, float post_base, float scale1,
                              float scale2) {
  __shared__ float cells[kMaxHc * kMaxHc];
  const int lane = threadIdx.x, hc = p.hc, n_cells = hc * hc;
  const float eps = p.hc_eps;
  if (lane < hc) p.post[int64_t(t) * hc + lane] = 2.0f * mix_gate(post_mix, rs, scale1, post_base);

  float val[2];
  bool own[2];
  int row0[2], col[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int e = lane + 32 * s;
    own[s] = e < n_cells;
    row0[s] = (e / hc) * hc;
    col[s] = e % hc;
    val[s] = __fadd_rn(__fmul_rn(__fmul_rn(comb_mix[s], rs), scale2), comb_base[s]);
  }
  auto publish = [&] {
    __syncwarp();  // everyone has read the previous values
#pragma unroll
    for (int s = 0; s < 2; ++s)
      if (own[s]) cells[lane + 32 * s] = val[s];
    __syncwarp();
  };
  auto row_total = [&](int s) {
    float sum = 0.0f;
    for (int k = 0; k < hc; ++k) sum = __fadd_rn(sum, cells[row0[s] + k]);
    return sum;
  };
  auto col_total = [&](int s) {
    float sum = 0.0f;
    for (int j = 0; j < hc; ++j) sum = __fadd_rn(sum, cells[j * hc + col[s]]);
    return sum;
  };

  publish();  // row softmax, then + eps
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (own[s]) {
      float mx = -INFINITY;
      for (int k = 0; k < hc; ++k) mx = fmaxf(mx, cells[row0[s] + k]);
      val[s] = expf(__fsub_rn(val[s], mx));
    }
  publish();
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (own[s]) val[s] = __fadd_rn(__fdiv_rn(val[s], row_total(s)), eps);
  publish();
  // Sinkhorn: columns, then (rows, columns) for the remaining iterations (the reference normalises the columns
  // once even for 0 iterations).
  const int rounds = p.sinkhorn_iters > 1 ? p.sinkhorn_iters : 1;
  for (int it = 0; it < rounds; ++it) {
    if (it > 0) {
#pragma unroll
      for (int s = 0; s < 2; ++s)
        if (own[s]) val[s] = __fdiv_rn(val[s], __fadd_rn(row_total(s), eps));
      publish();
    }
#pragma unroll
    for (int s = 0; s < 2; ++s)
      if (own[s]) val[s] = __fdiv_rn(val[s], __fadd_rn(col_total(s), eps));
    publish();
  }
#pragma unroll
  for (int s = 0; s < 2; ++s)
    if (own[s]) p.comb[int64_t(t) * n_cells + lane + 32 * s] = val[s];
}

// post_and_comb for hc == HC known at compile time (the models' hc_mult 4): lane l owns cell (l / HC, l % HC) in a
// register and reads the other cells of its row or column with shuffles, adding them in index order like the
// sequential reference (same bits as post_and_comb). The Sinkhorn iterations are the critical path of hc_pre at
// decode: one warp's dependent chain, which this keeps short (no shared-memory round trips or warp barriers).
template <int HC>
__device__ void post_and_comb_fixed(const HcPreParams& p, int t, float rs, float comb_mix, float comb_base,
                                    float post_mix, float post_base, float scale1, float scale2) {
  static_assert(HC * HC <= 32, "one cell per lane");
  const int lane = threadIdx.x, row0 = (lane / HC) * HC, col = lane % HC;
  const float eps = p.hc_eps;
  if (lane < HC) p.post[int64_t(t) * HC + lane] = 2.0f * mix_gate(post_mix, rs, scale1, post_base);
  // Lanes past HC² compute on other lanes' cells and store nothing.
  auto row_total = [&](float v) {
    float sum = __shfl_sync(0xffffffffu, v, row0);
#pragma unroll
    for (int k = 1; k < HC; ++k) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, row0 + k));
    return sum;
  };
  auto col_total = [&](float v) {
    float sum = __shfl_sync(0xffffffffu, v, col);
#pragma unroll
    for (int j = 1; j < HC; ++j) sum = __fadd_rn(sum, __shfl_sync(0xffffffffu, v, j * HC + col));
    return sum;
  };
  float val = __fadd_rn(__fmul_rn(__fmul_rn(comb_mix, rs), scale2), comb_base);
  float mx = -INFINITY;  // row softmax, then + eps
#pragma unroll
  for (int k = 0; k < HC; ++k) mx = fmaxf(mx, __shfl_sync(0xffffffffu, val, row0 + k));
  val = expf(__fsub_rn(val, mx));
  val = __fadd_rn(__fdiv_rn(val, row_total(val)), eps);
  const int rounds = p.sinkhorn_iters > 1 ? p.sinkhorn_iters : 1;  // columns first, as post_and_comb
  for (int it = 0; it < rounds; ++it) {
    if (it > 0) val = __fdiv_rn(val, __fadd_rn(row_total(val), eps));
    val = __fdiv_rn(val, __fadd_rn(col_total(val), eps));
  }
  if (lane < HC * HC) p.comb[int64_t(t) * HC * HC + lane] = val;
}

// Grid (n, 2): block (t, 0) collapses and normalises token t, block (t, 1) computes its post and comb (the
// Sinkhorn iterations, ~40 dependent steps on one warp) at the same time. Both compute rs from the streams. With
// p.parts Collapse or PostComb the grid is (n, 1) and every block does that half.
template <int kHc>
__global__ void __launch_bounds__(hc_max_threads(kHc)) hc_pre_kernel(HcPreParams p) {
  gpu::dependent_enter();
  extern __shared__ float4 hc_smem[];
  const int t = blockIdx.x, hc = p.hc, D = p.D, n_mix = (2 + hc) * hc;
  const float* xs = p.streams + int64_t(t) * hc * D;
  const float* m = p.mix_partials ? nullptr : p.mix + int64_t(t) * n_mix;
  __shared__ float mix_sum[kHcMixMax];
  if (p.mix_partials) {
    if (int(threadIdx.x) < n_mix) mix_sum[threadIdx.x] = summed_mix_partials(p, t, threadIdx.x, n_mix);
    __syncthreads();
    m = mix_sum;
  }
  const bool collapse = p.parts == HcPreParts::Both ? blockIdx.y == 0 : p.parts == HcPreParts::Collapse;
  if (collapse) {
    collapse_and_norm<kHc>(xs, hc, D, m, p.base, p.scale, p.hc_eps, p.norm_weight, p.eps,
                           p.normed ? p.normed + int64_t(t) * D : nullptr,
                           p.normed_bf16 ? p.normed_bf16 + int64_t(t) * D : nullptr, reinterpret_cast<float*>(hc_smem));
    return;
  }
  // Warp 0's mix and base values go out before the reduction.
  const int lane = threadIdx.x;
  float comb_mix[2] = {0.0f, 0.0f}, comb_base[2] = {0.0f, 0.0f}, post_mix = 0.0f, post_base = 0.0f;
  float scale1 = 0.0f, scale2 = 0.0f;
  if (lane < 32) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int e = lane + 32 * s;
      if (e < hc * hc) {
        comb_mix[s] = m[2 * hc + e];
        comb_base[s] = p.base[2 * hc + e];
      }
    }
    if (lane < hc) {
      post_mix = m[hc + lane];
      post_base = p.base[hc + lane];
    }
    scale1 = p.scale[1];
    scale2 = p.scale[2];
  }
  const float rs = streams_inv_rms(streams_sum_sq<kHc>(xs, hc, D, D % 4 == 0 && aligned_dev(xs, 16)), hc * D, p.eps);
  if (lane >= 32) return;  // no block-wide barrier follows
  if (hc == 4)
    post_and_comb_fixed<4>(p, t, rs, comb_mix[0], comb_base[0], post_mix, post_base, scale1, scale2);
  else
    post_and_comb(p, t, rs, comb_mix, comb_base, post_mix, post_base, scale1, scale2);
}

// mHC post (2.4) of token t at columns d .. d + 3, in two pieces shared by hc_post and hc_pre's fused post.
// The sublayer output it adds: out[t, 0] + .. + out[t, out_k - 1] (+ out2[t]), summed in that order.
__device__ __forceinline__ float4 post_output4(const float* out, int out_k, const float* out2, int t, int D, int d) {
  float4 o = *reinterpret_cast<const float4*>(out + int64_t(t) * out_k * D + d);
#pragma unroll 4
  for (int e = 1; e < out_k; ++e) {
    const float4 a = *reinterpret_cast<const float4*>(out + (int64_t(t) * out_k + e) * D + d);
    o = make_float4(__fadd_rn(o.x, a.x), __fadd_rn(o.y, a.y), __fadd_rn(o.z, a.z), __fadd_rn(o.w, a.w));
  }
  if (out2) {
    const float4 a = *reinterpret_cast<const float4*>(out2 + int64_t(t) * D + d);
    o = make_float4(__fadd_rn(o.x, a.x), __fadd_rn(o.y, a.y), __fadd_rn(o.z, a.z), __fadd_rn(o.w, a.w));
  }
  return o;
}
// New stream k: post[t, k] · o + Σ_j comb[t, j, k] · old[j] over the token's hc <= kHc old streams, in j order.
template <int kHc>
__device__ __forceinline__ float4 posted4(const float* post, const float* comb, int hc, int t, int k, float4 o,
                                          const float4 (&old)[kHc]) {
  const float* C = comb + int64_t(t) * hc * hc;
  const float pk = post[int64_t(t) * hc + k];
  float4 acc = make_float4(__fmul_rn(pk, o.x), __fmul_rn(pk, o.y), __fmul_rn(pk, o.z), __fmul_rn(pk, o.w));
#pragma unroll
  for (int j = 0; j < kHc; ++j)
    if (j < hc) {
      const float c = C[j * hc + k];
      acc.x = __fadd_rn(acc.x, __fmul_rn(c, old[j].x));
      acc.y = __fadd_rn(acc.y, __fmul_rn(c, old[j].y));
      acc.z = __fadd_rn(acc.z, __fmul_rn(c, old[j].z));
      acc.w = __fadd_rn(acc.w, __fmul_rn(c, old[j].w));
    }
  return acc;
}

// Stream k of token t at columns d .. d + 3 after the previous sublayer's mHC post (HcPreParams::prev_out, with its
// post and comb): hc_post's arithmetic for that one stream, nothing stored.
template <int kHc>
__device__ __forceinline__ float4 posted_stream(const HcPreParams& p, int t, int k, int d) {
  const int D = p.D;
  const float* xs = p.streams + int64_t(t) * kHc * D;
  float4 old[kHc];
#pragma unroll
  for (int j = 0; j < kHc; ++j) old[j] = *reinterpret_cast<const float4*>(xs + int64_t(j) * D + d);
  const float4 o = post_output4(p.prev_out, p.prev_out_k, p.prev_out2, t, D, d);
  return posted4<kHc>(p.post, p.comb, kHc, t, k, o, old);
}

// hc_pre's collapse + norm for decode-sized chunks, and with HcPreParams::fn the mix before it, in one launch: the
// kHcCluster blocks of a cluster each take D / 16 columns of all hc streams of `tokens` consecutive tokens (and the
// matching columns of every fn row: 24 x 4 x 256 floats, 96 KB for the Flash shape, so the 1.5 MB of fn is spread
// over 16 SMs with every load in flight at once). Per token, each block's partial mix and the streams' sum of squares
// go through a warp tree and the warps in order, then the cluster adds the blocks in rank order through distributed
// shared memory; every block then has the whole mix and rs, collapses its own columns and adds the collapsed row's
// sum of squares the same way. Per element the same arithmetic as collapse_and_norm; the fp64 sums go in another
// order; a token's sums do not depend on how many tokens share its cluster (batched rows keep the bits of a row
// decoded alone). Larger batches put more tokens in a cluster (hc_pre: at most 8 clusters' worth of blocks), which
// reads each block's fn columns once for all of them. (One block per token, 1024 threads, read the 64 KB row through
// one SM in a chain of two block reductions: 8 µs per call under ncu at decode, twice per layer on the critical
// path, plus the mix's own launch.)
constexpr int kHcCluster = 16;  // non-portable: Hopper clusters take up to 16 blocks
constexpr int kHcClusterThreads = 256;
constexpr int kHcClusterTokens = 8;  // tokens per cluster at most (hc_pre: n < 64 over at most 8 clusters)
// Dynamic shared memory for 8 tokens' stream and collapsed groups at D = 8192 (hc_pre takes D <= kHcClusterMaxD).
constexpr int kHcClusterMaxD = 8192;
constexpr int kHcClusterSmem = kHcClusterTokens * 5 * (kHcClusterMaxD / 4 / kHcCluster) * 16;

template <int kHc, bool kMixes>  // kMixes: p.fn is given
__global__ void __launch_bounds__(kHcClusterThreads, 1)
    hc_collapse_cluster_kernel(HcPreParams p, int tokens, bool early) {
  constexpr int kMix = (2 + kHc) * kHc, kWarps = kHcClusterThreads / 32, kT = kHcClusterTokens;
  gpu::allow_dependents();
  extern __shared__ float4 hc_smem[];  // stream groups [tokens][kHc][groups], then the collapsed ones [tokens][groups]
  __shared__ float warp_mix[kT][kWarps][kMix];
  __shared__ double warp_ss[kT][kWarps];
  __shared__ float block_mix[kT][kMix];  // this block's partials, read by the whole cluster
  __shared__ double block_ss[2][kT];
  __shared__ float mix_s[kT][kMix];
  __shared__ float rs_s[kT], inv_rms_s[kT];
  cg::cluster_group cluster = cg::this_cluster();
  const int D = p.D, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.y * tokens, count = min(tokens, p.n - t0);
  const int groups = D / 4 / kHcCluster, g0 = int(cluster.block_rank()) * groups, items = kHc * groups;
  const float4* fn = reinterpret_cast<const float4*>(p.fn);
  const int64_t fn_row = int64_t(kHc) * D / 4;  // float4 per fn row
  float4* own = hc_smem;                          // [count][items]
  float4* collapsed = hc_smem + count * items;    // [count][groups]
  auto column = [&](int i) { return int64_t(i / groups) * D / 4 + g0 + i % groups; };  // (stream, group) as float4

  // A thread's fn columns are the same for every token: with one item per thread (items <= threads, Flash) they
  // are loaded once, under `early` before the wait for the previous kernel (fn is a weight); else per item
  // (L1 hits after the first token).
  const int first = threadIdx.x;
  const bool one_item = items <= kHcClusterThreads;
  float4 w[kMixes ? kMix : 1];
  auto load_fn = [&](int64_t at) {
    if constexpr (kMixes) {
#pragma unroll
      for (int m = 0; m < kMix; ++m) w[m] = __ldg(fn + m * fn_row + at);
    }
  };
  if (kMixes && early && first < items) load_fn(column(first));
  gpu::dependent_wait();
  for (int j = 0; j < count; ++j) {
    const float4* xs = reinterpret_cast<const float4*>(p.streams + int64_t(t0 + j) * kHc * D);
    float mix[kMix];
#pragma unroll
    for (int m = 0; m < kMix; ++m) mix[m] = 0.0f;
    double ss = 0;
    for (int i = threadIdx.x; i < items; i += kHcClusterThreads) {
      const int64_t at = column(i);
      // With prev_out, stream i / groups of the column group after the previous sublayer's post (stored below).
      const float4 v = p.prev_out ? posted_stream<kHc>(p, t0 + j, i / groups, 4 * (g0 + i % groups)) : xs[at];
      if constexpr (kMixes) {
        const bool loaded = i == first && (one_item ? early || j > 0 : early && j == 0);
        if (!loaded) load_fn(at);
#pragma unroll
        for (int m = 0; m < kMix; ++m) mix[m] = dot_acc(v, w[m], mix[m]);
      }
      own[j * items + i] = v;
      ss += sum_sq4(v);
    }
    if constexpr (kMixes) {
#pragma unroll
      for (int m = 0; m < kMix; ++m) {
        const float s = detail::warp_sum(mix[m]);
        if (lane == 0) warp_mix[j][warp][m] = s;
      }
    }
    ss = detail::warp_sum(ss);
    if (lane == 0) warp_ss[j][warp] = ss;
  }
  __syncthreads();
  if (p.prev_out)  // every old value of the block's columns has been read: the posted streams go out
    for (int idx = threadIdx.x; idx < count * items; idx += kHcClusterThreads) {
      const int j = idx / items, i = idx % items;
      reinterpret_cast<float4*>(const_cast<float*>(p.streams) + int64_t(t0 + j) * kHc * D)[column(i)] = own[idx];
    }
  for (int idx = threadIdx.x; idx < count * (kMix + 1); idx += kHcClusterThreads) {
    const int j = idx / (kMix + 1), m = idx % (kMix + 1);
    if (m < kMix) {
      if (!kMixes) continue;
      float s = 0.0f;
      for (int w = 0; w < kWarps; ++w) s += warp_mix[j][w][m];
      block_mix[j][m] = s;
    } else {
      double s = 0;
      for (int w = 0; w < kWarps; ++w) s += warp_ss[j][w];
      block_ss[0][j] = s;
    }
  }
  cluster.sync();  // every block's partials are final
  for (int idx = threadIdx.x; idx < count * (kMix + 1); idx += kHcClusterThreads) {
    const int j = idx / (kMix + 1), m = idx % (kMix + 1), t = t0 + j;
    if (m < kMix) {
      float s = 0.0f;
      if (kMixes) {
        for (int r = 0; r < kHcCluster; ++r) s += cluster.map_shared_rank(&block_mix[0][0], r)[j * kMix + m];
        if (cluster.block_rank() == 0) p.mix_out[int64_t(t) * kMix + m] = s;
      } else if (p.mix_partials) {
        s = summed_mix_partials(p, t, m, kMix);
      } else {
        s = p.mix[int64_t(t) * kMix + m];
      }
      mix_s[j][m] = s;
    } else {
      double s = 0;
      for (int r = 0; r < kHcCluster; ++r) s += cluster.map_shared_rank(&block_ss[0][0], r)[j];
      rs_s[j] = streams_inv_rms(s, kHc * D, p.eps);
    }
  }
  __syncthreads();
  const float scale0 = p.scale[0];
  for (int j = 0; j < count; ++j) {
    float pre[kHc];
#pragma unroll
    for (int k = 0; k < kHc; ++k) pre[k] = __fadd_rn(mix_gate(mix_s[j][k], rs_s[j], scale0, p.base[k]), p.hc_eps);
    double ss2 = 0;
    for (int g = threadIdx.x; g < groups; g += kHcClusterThreads) {
      float4 v[kHc];
#pragma unroll
      for (int k = 0; k < kHc; ++k) v[k] = own[j * items + k * groups + g];
      const float4 acc = collapse4<kHc>(pre, v, kHc);
      collapsed[j * groups + g] = acc;
      ss2 += sum_sq4(acc);
    }
    ss2 = detail::warp_sum(ss2);
    if (lane == 0) warp_ss[j][warp] = ss2;  // the first pass's values were read before the cluster barrier
  }
  __syncthreads();
  if (int(threadIdx.x) < count) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += warp_ss[threadIdx.x][w];
    block_ss[1][threadIdx.x] = s;
  }
  cluster.sync();
  if (int(threadIdx.x) < count) {
    double total = 0;
    for (int r = 0; r < kHcCluster; ++r) total += cluster.map_shared_rank(&block_ss[1][0], r)[threadIdx.x];
    inv_rms_s[threadIdx.x] = 1.0f / sqrtf(float(total / D) + p.eps);
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < count * groups; idx += kHcClusterThreads) {
    const int j = idx / groups, g = idx % groups, t = t0 + j, d = 4 * (g0 + g);
    const float4 out = norm4(collapsed[idx], inv_rms_s[j], *reinterpret_cast<const float4*>(p.norm_weight + d));
    if (p.normed) store4(p.normed + int64_t(t) * D, d, D, true, out);
    if (p.normed_bf16) store4_bf16(p.normed_bf16 + int64_t(t) * D, d, D, true, out);
  }
  cluster.sync();  // block_mix and block_ss must outlive the other blocks' reads
}

template <int kHc>
__global__ void __launch_bounds__(hc_max_threads(kHc))
    hc_head_kernel(const float* streams, const float* mix, const float* base, const float* scale,
                   const float* norm_weight, int hc, int D, float hc_eps, float eps, uint16_t* y_bf16) {
  gpu::dependent_enter();
  extern __shared__ float4 hc_smem[];
  const int t = blockIdx.x;
  collapse_and_norm<kHc>(streams + int64_t(t) * hc * D, hc, D, mix + int64_t(t) * hc, base, scale, hc_eps,
                         norm_weight, eps, nullptr, y_bf16 + int64_t(t) * D, reinterpret_cast<float*>(hc_smem));
}

// Threads for one token's D columns in groups of four.
int hc_threads(int D, int hc_bound) {
  const int groups = (D + 3) / 4, limit = hc_max_threads(hc_bound);
  const int warps = (groups + 31) / 32;
  return warps * 32 < limit ? warps * 32 : limit;
}

constexpr int kHcPrefillRows = 64;  // hc_pre rows from which a row gets 256 threads
constexpr int kHcMixThreads = 32;   // hc_post_mix: one warp per 32 column groups (128 columns) of a token
constexpr int kHcPostThreads = 64;  // a decode step's 1024 column groups over 16 blocks

// Columns d .. d + 3 of token t: o = the out_k picks summed in order (+ out2), then stream k <- post_k · o +
// Σ_j comb[j, k] · old_j for k < hc, stored, and kept in fresh[k] when fresh is given. 16-byte groups: D % 4 == 0
// and every pointer aligned.
template <int kHc>
__device__ __forceinline__ void hc_post_group(const float* out, int out_k, const float* out2, const float* post,
                                              const float* comb, int hc, int D, int t, int d, float* streams,
                                              float4* fresh) {
  float* xs = streams + int64_t(t) * hc * D;
  float4 old[kHc];
#pragma unroll
  for (int j = 0; j < kHc; ++j)
    if (j < hc) old[j] = *reinterpret_cast<const float4*>(xs + int64_t(j) * D + d);
  const float4 o = post_output4(out, out_k, out2, t, D, d);
  for (int k = 0; k < hc; ++k) {
    const float4 acc = posted4<kHc>(post, comb, hc, t, k, o, old);
    *reinterpret_cast<float4*>(xs + int64_t(k) * D + d) = acc;
    if (fresh) fresh[k] = acc;
  }
}

__global__ void __launch_bounds__(kHcPostThreads)
    hc_post_vec_kernel(const float* out, int out_k, const float* out2, const float* post, const float* comb, int n,
                       int hc, int D, float* streams) {
  gpu::dependent_enter();
  const int D4 = D / 4;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * D4) return;
  hc_post_group<kMaxHc>(out, out_k, out2, post, comb, hc, D, int(i / D4), int(i % D4) * 4, streams, nullptr);
}

// Any D or alignment: one column per thread.
__global__ void hc_post_kernel(const float* out, int out_k, const float* out2, const float* post, const float* comb,
                               int n, int hc, int D, float* streams) {
  gpu::dependent_enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * D) return;
  const int t = int(i / D), d = int(i % D);
  float* xs = streams + int64_t(t) * hc * D;
  float old[kMaxHc];
  for (int j = 0; j < hc; ++j) old[j] = xs[j * D + d];
  float o = out[(int64_t(t) * out_k) * D + d];
  for (int e = 1; e < out_k; ++e) o = __fadd_rn(o, out[(int64_t(t) * out_k + e) * D + d]);
  if (out2) o = __fadd_rn(o, out2[i]);
  const float* C = comb + int64_t(t) * hc * hc;
  for (int k = 0; k < hc; ++k) {
    float acc = __fmul_rn(post[t * hc + k], o);
    for (int j = 0; j < hc; ++j) acc = __fadd_rn(acc, __fmul_rn(C[j * hc + k], old[j]));
    xs[k * D + d] = acc;
  }
}

// hc_post_group for hc = 4 on block (column block b, token t), then the block's partial products of the new
// streams with the n_mix rows of fn (fmaf chains over the 4 streams, then a warp tree) into partials[t, m, b].
__global__ void __launch_bounds__(kHcMixThreads) hc_post_mix_kernel(HcPostMixParams p) {
  constexpr int kHc = 4;
  gpu::dependent_enter();
  const int t = blockIdx.y, D = p.D, d = (int(blockIdx.x) * kHcMixThreads + int(threadIdx.x)) * 4;
  float4 fresh[kHc];
#pragma unroll
  for (int k = 0; k < kHc; ++k) fresh[k] = make_float4(0, 0, 0, 0);
  if (d < D) hc_post_group<kHc>(p.out, p.out_k, p.out2, p.post, p.comb, kHc, D, t, d, p.streams, fresh);
  const int blocks = gridDim.x;
#pragma unroll
  for (int m = 0; m < kHcMixMax; ++m) {
    if (m >= p.n_mix) break;  // uniform over the block
    float acc = 0.0f;
    if (d < D) {
      const float* f = p.fn + int64_t(m) * kHc * D + d;  // weights: no kernel of the step writes them
#pragma unroll
      for (int k = 0; k < kHc; ++k) {
        const float4 w = __ldg(reinterpret_cast<const float4*>(f + int64_t(k) * D));
        acc = fmaf(fresh[k].x, w.x, acc);
        acc = fmaf(fresh[k].y, w.y, acc);
        acc = fmaf(fresh[k].z, w.z, acc);
        acc = fmaf(fresh[k].w, w.w, acc);
      }
    }
    acc = detail::warp_sum(acc);
    if (threadIdx.x == 0) p.partials[(int64_t(t) * p.n_mix + m) * blocks + blockIdx.x] = acc;
  }
}

// ---- the rest ----------------------------------------------------------------------------------------------------

__global__ void embed_kernel(const uint16_t* embed, const int32_t* tokens, int n, int D, int hc, float* streams) {
  gpu::dependent_enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * hc * D) return;
  const int d = int(i % D), t = int(i / (int64_t(hc) * D));
  streams[i] = bf16_to_f32(embed[int64_t(tokens[t]) * D + d]);
}

__global__ void window_store_kernel(const float* kv, int n, int dim, int64_t pos0, const int64_t* pos_device,
                                    float* window, int slots) {
  gpu::dependent_enter();
  if (pos_device) pos0 = *pos_device;
  const int first = n > slots ? n - slots : 0;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n - first) * dim) return;
  const int t = first + int(i / dim), c = int(i % dim);
  window[((pos0 + t) % slots) * dim + c] = kv[int64_t(t) * dim + c];
}

__global__ void rms_norm_rows_kernel(RmsNormRowsParams p) {
  gpu::dependent_enter();
  const int r = blockIdx.x;
  const float* x = p.table ? nullptr : p.x + int64_t(r) * p.ld;
  const uint16_t* t = p.table ? p.table + int64_t(p.ids[r]) * p.dim : nullptr;
  auto value = [&](int i) { return t ? bf16_to_f32(t[i]) : x[i]; };
  double ss = 0;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x) {
    const float v = value(i);
    ss += double(v) * v;
  }
  ss = block_sum(ss);
  const float inv_rms = 1.0f / sqrtf(float(ss / p.dim) + p.eps);
  uint16_t* y = p.y_bf16 + int64_t(r) * p.dim;
  for (int i = threadIdx.x; i < p.dim; i += blockDim.x)
    y[i] = f32_to_bf16(__fmul_rn(__fmul_rn(value(i), inv_rms), p.weight ? p.weight[i] : 1.0f));
}

__global__ void add_to_streams_kernel(float* streams, const float* e, int n, int hc, int D) {
  gpu::dependent_enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(n) * hc * D) return;
  const int64_t t = i / (int64_t(hc) * D), d = i % D;
  streams[i] = __fadd_rn(streams[i], e[t * D + d]);
}

__global__ void fill_kernel(float* x, int64_t n, float value) {
  gpu::dependent_enter();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = value;
}

}  // namespace

namespace {

// Checks p and returns the threads one row needs (groups of four values, see row_op_kernel).
int row_threads(const RowOpParams& p) {
  OPS_CHECK(p.dim > 0 && p.dim <= 4096, "row_op: dim %d outside (0, 4096]", p.dim);
  OPS_CHECK(p.rope_dim >= 0 && p.rope_dim <= p.dim, "row_op: rope_dim %d outside [0, dim = %d]", p.rope_dim, p.dim);
  OPS_CHECK(p.emit_ratio == 0 || p.tokens * p.heads == 1 || (p.rows_base && p.pos_rows && p.heads == 1),
            "row_op: emit_ratio needs one row (or rows_base and pos_rows, one head), got %d", p.tokens * p.heads);
  OPS_CHECK(p.round != RowRound::KvFp8 || (p.dim - p.rope_dim) % 64 == 0,
             "row_op: FP8 KV rounding needs (dim - rope_dim) = %d to be a multiple of 64", p.dim - p.rope_dim);
  OPS_CHECK(p.round != RowRound::IndexerFp4 || (p.dim >= 32 && (p.dim & (p.dim - 1)) == 0 && p.rope_dim % 2 == 0),
             "row_op: FP4 indexer rounding needs a power-of-two dim >= 32 and an even rope_dim, got %d / %d", p.dim,
             p.rope_dim);
  const int shift = p.rope_dim > 0 ? (p.dim - p.rope_dim) & 1 : 0;
  const int threads = (p.dim + shift + kRowValues - 1) / kRowValues;
  OPS_CHECK(threads <= 1024, "row_op: dim %d with an odd dim - rope_dim needs dim < 4096", p.dim);
  return threads;
}

size_t row_smem(const RowOpParams& p) {
  return p.round == RowRound::IndexerFp4 && p.dim > 32 * kRowValues ? p.dim * sizeof(float) : 0;
}

}  // namespace

void row_op(const RowOpParams& p, cudaStream_t stream) {
  const int rows = p.tokens * p.heads;
  if (rows == 0) return;
  const int threads = row_threads(p);
  int lanes = 1, rows_per_block = 1;
  if (threads > 32) {
    lanes = (threads + 31) / 32 * 32;
  } else {
    while (lanes < threads) lanes *= 2;
    rows_per_block = (rows >= 1024 ? 128 : 32) / lanes;  // a warp at least; 4 warps for prefill-sized launches
  }
  if (p.rows_base) {  // batched entry finishing: a row that completes no entry leaves as a whole block
    lanes = (lanes + 31) / 32 * 32;  // lanes past the row's values hold zeros and store nothing
    rows_per_block = 1;
  }
  const int blocks = (rows + rows_per_block - 1) / rows_per_block;
  gpu::launch(row_op_kernel, blocks, lanes * rows_per_block, row_smem(p), stream, p, lanes, rows_per_block);
  DSV4_CUDA_LAUNCHED();
}

void row_op_pair(const RowOpParams& a, const RowOpParams& b, cudaStream_t stream) {
  const int rows_a = a.tokens * a.heads, rows_b = b.tokens * b.heads;
  const int threads_a = rows_a ? row_threads(a) : 0, threads_b = rows_b ? row_threads(b) : 0;
  if (rows_a + rows_b == 0) return;
  OPS_CHECK(!a.rows_base && !b.rows_base, "row_op_pair: batched entry finishing (rows_base) runs alone");
  // Blocks as wide as the wider op's row. A row of <= 32 threads keeps row_op's lanes (a power of two) and the
  // block takes several such rows (the indexer's 128-value q rows, 4 per block beside 512-value ones: one row per
  // block made the pair 2.6x slower than the two launches on a 512-token prefill chunk); a wider one is padded to
  // the block (padded lanes hold zeros and store nothing).
  const int block = (std::max({threads_a, threads_b, 32}) + 31) / 32 * 32;
  auto shape_of = [block](int threads) {
    if (threads > 32) return RowShape{block, 1};
    int lanes = 1;
    while (lanes < threads) lanes *= 2;
    return RowShape{lanes, block / lanes};
  };
  const RowShape shape_a = shape_of(threads_a), shape_b = shape_of(threads_b);
  // The Hadamard stages of an FP4-rounded row wider than a warp's values go through shared memory with barriers:
  // that row must fill the block. Narrower ones stay within their warp.
  auto fp4_fits = [block](const RowOpParams& p, int threads) {
    return p.round != RowRound::IndexerFp4 || p.dim <= 32 * kRowValues || threads == block;
  };
  OPS_CHECK(fp4_fits(a, threads_a) && fp4_fits(b, threads_b),
            "row_op_pair: FP4 indexer rounding across warps needs its row to fill the block (%d / %d of %d lanes)",
            threads_a, threads_b, block);
  const int blocks_a = (rows_a + shape_a.rows_per_block - 1) / shape_a.rows_per_block;
  const int blocks_b = (rows_b + shape_b.rows_per_block - 1) / shape_b.rows_per_block;
  const size_t smem = std::max(rows_a ? row_smem(a) : 0, rows_b ? row_smem(b) : 0);
  gpu::launch(row_op_pair_kernel, blocks_a + blocks_b, block, smem, stream, a, b, blocks_a, shape_a, shape_b);
  DSV4_CUDA_LAUNCHED();
}

void linear_f32(const LinearF32Params& p, cudaStream_t stream) {
  if (int64_t(p.m) * p.n == 0) return;
  if (p.m >= kLinearTallRows && p.k % 4 == 0 && aligned(p.x, 16) && aligned(p.w, 16)) {
    if (p.n <= 8)
      launch_linear_f32_prefill<8>(p, stream);
    else if (p.n <= 16)
      launch_linear_f32_prefill<16>(p, stream);
    else if (p.n <= 24)
      launch_linear_f32_prefill<24>(p, stream);
    else
      launch_linear_f32_prefill<32>(p, stream);
    return;
  }
  const int rows_per_block = detail::linear_f32_rows_per_block(p.m);
  const int64_t row_groups = (p.m + rows_per_block - 1) / rows_per_block;
  OPS_CHECK(row_groups <= 65535, "linear_f32: m = %d rows exceed one grid", p.m);
  const int slices = detail::linear_f32_slices(p, current_sm_count());
  OPS_CHECK(int64_t(p.n) * slices <= 0x7fffffff, "linear_f32: n = %d columns exceed one grid", p.n);
  const bool vec = p.k % 4 == 0 && aligned(p.x, 16) && aligned(p.w, 16);
  if (rows_per_block == 4)
    vec ? launch_linear_f32<4, 4>(p, slices, stream) : launch_linear_f32<4, 1>(p, slices, stream);
  else
    vec ? launch_linear_f32<1, 4>(p, slices, stream) : launch_linear_f32<1, 1>(p, slices, stream);
}

void embed_tokens(const uint16_t* embed, const int32_t* tokens, int n, int D, int hc, float* streams,
                  cudaStream_t stream) {
  gpu::launch(embed_kernel, blocks_for(int64_t(n) * hc * D, 256), 256, 0, stream, embed, tokens, n, D, hc, streams);
  DSV4_CUDA_LAUNCHED();
}

namespace {
bool g_hc_collapse_cluster = true;  // set_hc_collapse_cluster

template <bool kMixes>
void launch_collapse_cluster(const HcPreParams& p, int tokens, dim3 grid, size_t smem, cudaStream_t stream) {
  constexpr auto kKernel = hc_collapse_cluster_kernel<4, kMixes>;
  const cudaError_t allowed = gpu::allow_nonportable_clusters<kKernel>();
  const cudaError_t sized = gpu::allow_dynamic_smem<kKernel>(kHcClusterSmem);
  OPS_CHECK(allowed == cudaSuccess && sized == cudaSuccess, "hc_pre: clusters of %d blocks with %d bytes not allowed",
            kHcCluster, kHcClusterSmem);
  const cudaError_t err = gpu::launch_ex(kKernel, grid, kHcClusterThreads, smem, kHcCluster, stream, p, tokens,
                                            gpu::early_other_weights());
  DSV4_CUDA_LAUNCHED();
  OPS_CHECK(err == cudaSuccess, "hc_pre: cluster launch failed: %s", cudaGetErrorString(err));
}
}  // namespace

void set_hc_collapse_cluster(bool on) { g_hc_collapse_cluster = on; }

int hc_pre(const HcPreParams& p, cudaStream_t stream) {
  OPS_CHECK(p.hc > 0 && p.hc <= kMaxHc, "hc_pre: hc_mult %d outside [1, %d]", p.hc, kMaxHc);
  OPS_CHECK(!p.mix_partials || (p.hc <= 4 && p.mix_blocks > 0), "hc_pre: mix partials need hc <= 4 and blocks > 0");
  OPS_CHECK(p.D > 0 && p.D <= kHcMaxD, "hc_pre: hidden size %d outside (0, %d]", p.D, kHcMaxD);
  OPS_CHECK(p.parts == HcPreParts::Collapse || (p.post && p.comb), "hc_pre: post and comb are required");
  OPS_CHECK(!p.fn || (p.mix_out && p.parts != HcPreParts::PostComb && !p.mix_partials),
            "hc_pre: fn needs mix_out, and not with parts PostComb or mix_partials");
  OPS_CHECK(!p.prev_out || (p.parts != HcPreParts::PostComb && p.prev_out_k > 0 && p.post && p.comb),
            "hc_pre: prev_out needs the previous post and comb, and not with parts PostComb");
  if (p.n == 0) return 0;
  // Decode-sized chunks collapse in a cluster per token (hc_collapse_cluster_kernel; the post + comb half, a one-warp
  // chain, then runs as a launch of its own); prefill chunks and other shapes run both halves in one launch, after
  // the mix's own launch when fn is given.
  const bool cluster = g_hc_collapse_cluster && p.parts != HcPreParts::PostComb && p.n < kHcPrefillRows && p.hc == 4 &&
                       p.D % (4 * kHcCluster) == 0 && p.D <= kHcClusterMaxD && aligned(p.streams, 16) &&
                       (!p.fn || aligned(p.fn, 16)) &&
                       aligned(p.norm_weight, 16) && (!p.normed || aligned(p.normed, 16)) &&
                       (!p.normed_bf16 || aligned(p.normed_bf16, 8)) &&
                       (!p.prev_out || (aligned(p.prev_out, 16) && (!p.prev_out2 || aligned(p.prev_out2, 16))));
  if (!cluster && p.prev_out) {
    hc_post(p.prev_out, p.prev_out_k, p.prev_out2, p.post, p.comb, p.n, p.hc, p.D, const_cast<float*>(p.streams),
            stream);
    HcPreParams after = p;
    after.prev_out = after.prev_out2 = nullptr;
    return 1 + hc_pre(after, stream);
  }
  HcPreParams rest = p;  // what is left after the first launch
  rest.prev_out = rest.prev_out2 = nullptr;
  if (p.fn) {
    rest.fn = nullptr;
    rest.mix = p.mix_out;
  }
  if (!cluster && p.fn) {
    linear_f32({p.streams, p.fn, p.mix_out, p.n, (2 + p.hc) * p.hc, p.hc * p.D, 1.0f}, stream);
    return 1 + hc_pre(rest, stream);
  }
  if (cluster) {
    const int groups = p.D / 4 / kHcCluster, tokens = (p.n + kHcClusterTokens - 1) / kHcClusterTokens;
    const int clusters = (p.n + tokens - 1) / tokens;
    const size_t smem = size_t(tokens) * (4 + 1) * groups * sizeof(float4);
    OPS_CHECK(smem <= size_t(kHcClusterSmem), "hc_pre: %zu bytes of shared memory for the cluster collapse", smem);
    const dim3 grid(kHcCluster, unsigned(clusters));
    if (p.fn)
      launch_collapse_cluster<true>(p, tokens, grid, smem, stream);
    else
      launch_collapse_cluster<false>(p, tokens, grid, smem, stream);
    if (p.parts == HcPreParts::Collapse) return 1;
    rest.parts = HcPreParts::PostComb;
    return 1 + hc_pre(rest, stream);
  }
  const dim3 grid(unsigned(p.n), p.parts == HcPreParts::Both ? 2 : 1);
  const size_t smem = size_t((p.D + 3) / 4) * sizeof(float4);
  // A decode step's few tokens spread each row over up to 1024 threads (latency); a prefill chunk's rows fill the
  // GPU anyway, so 256 threads per row let 8 rows share an SM instead of 2 (measured 72 -> see docs/perf.md).
  auto threads = [&](int bound) {
    return p.n >= kHcPrefillRows ? std::min(hc_threads(p.D, bound), 256) : hc_threads(p.D, bound);
  };
  if (p.hc <= 4)
    gpu::launch(hc_pre_kernel<4>, grid, threads(4), smem, stream, p);
  else
    gpu::launch(hc_pre_kernel<kMaxHc>, grid, threads(kMaxHc), smem, stream, p);
  DSV4_CUDA_LAUNCHED();
  return 1;
}

void hc_post(const float* out, int out_k, const float* out2, const float* post, const float* comb, int n, int hc,
             int D, float* streams, cudaStream_t stream) {
  OPS_CHECK(hc > 0 && hc <= kMaxHc, "hc_post: hc_mult %d outside [1, %d]", hc, kMaxHc);
  OPS_CHECK(out_k > 0, "hc_post: out_k %d must be positive", out_k);
  if (int64_t(n) * D == 0) return;
  if (D % 4 == 0 && aligned(out, 16) && (!out2 || aligned(out2, 16)) && aligned(streams, 16)) {
    gpu::launch(hc_post_vec_kernel, blocks_for(int64_t(n) * (D / 4), kHcPostThreads), kHcPostThreads, 0, stream,
                out, out_k, out2, post, comb, n, hc, D, streams);
  } else {
    gpu::launch(hc_post_kernel, blocks_for(int64_t(n) * D, 256), 256, 0, stream, out, out_k, out2, post, comb, n, hc,
                D, streams);
  }
  DSV4_CUDA_LAUNCHED();
}

int hc_post_mix_blocks(int D) { return (D / 4 + kHcMixThreads - 1) / kHcMixThreads; }

void hc_post_mix(const HcPostMixParams& p, cudaStream_t stream) {
  OPS_CHECK(p.hc == 4, "hc_post_mix: hc_mult %d (the fused kernel is for hc = 4)", p.hc);
  OPS_CHECK(p.n_mix > 0 && p.n_mix <= kHcMixMax, "hc_post_mix: %d mix outputs outside [1, %d]", p.n_mix, kHcMixMax);
  OPS_CHECK(p.out_k > 0, "hc_post_mix: out_k %d must be positive", p.out_k);
  OPS_CHECK(p.D > 0 && p.D % 4 == 0 && aligned(p.out, 16) && (!p.out2 || aligned(p.out2, 16)) &&
                aligned(p.streams, 16) && aligned(p.fn, 16),
            "hc_post_mix: D %d must be a multiple of 4 and out / out2 / streams / fn 16-byte aligned", p.D);
  if (p.n == 0) return;
  gpu::launch(hc_post_mix_kernel, dim3(unsigned(hc_post_mix_blocks(p.D)), unsigned(p.n)), kHcMixThreads, 0, stream,
              p);
  DSV4_CUDA_LAUNCHED();
}

void hc_head_norm(const float* streams, const float* mix, const float* base, const float* scale,
                  const float* norm_weight, int n, int hc, int D, float hc_eps, float eps, uint16_t* y_bf16,
                  cudaStream_t stream) {
  OPS_CHECK(hc > 0 && hc <= kMaxHc, "hc_head_norm: hc_mult %d outside [1, %d]", hc, kMaxHc);
  OPS_CHECK(D > 0 && D <= kHcMaxD, "hc_head_norm: hidden size %d outside (0, %d]", D, kHcMaxD);
  if (n == 0) return;
  const size_t smem = size_t((D + 3) / 4) * sizeof(float4);
  if (hc <= 4)
    gpu::launch(hc_head_kernel<4>, n, hc_threads(D, 4), smem, stream, streams, mix, base, scale, norm_weight, hc, D,
                hc_eps, eps, y_bf16);
  else
    gpu::launch(hc_head_kernel<kMaxHc>, n, hc_threads(D, kMaxHc), smem, stream, streams, mix, base, scale, norm_weight,
                hc, D, hc_eps, eps, y_bf16);
  DSV4_CUDA_LAUNCHED();
}

void rms_norm_rows(const RmsNormRowsParams& p, cudaStream_t stream) {
  OPS_CHECK(p.dim > 0 && (p.table ? p.ids != nullptr : p.x != nullptr) && p.y_bf16,
            "rms_norm_rows: dim %d, rows from x or from table + ids, and y_bf16 are required", p.dim);
  if (p.rows == 0) return;
  gpu::launch(rms_norm_rows_kernel, p.rows, 256, 0, stream, p);
  DSV4_CUDA_LAUNCHED();
}

void add_to_streams(float* streams, const float* e, int n, int hc, int D, cudaStream_t stream) {
  if (int64_t(n) * hc * D == 0) return;
  gpu::launch(add_to_streams_kernel, blocks_for(int64_t(n) * hc * D, 256), 256, 0, stream, streams, e, n, hc, D);
  DSV4_CUDA_LAUNCHED();
}

void window_store(const float* kv_chunk, int n, int dim, int64_t pos0, const int64_t* pos_device, float* window,
                  int slots, cudaStream_t stream) {
  const int rows = n < slots ? n : slots;
  gpu::launch(window_store_kernel, blocks_for(int64_t(rows) * dim, 256), 256, 0, stream, kv_chunk, n, dim, pos0,
              pos_device, window, slots);
  DSV4_CUDA_LAUNCHED();
}

__global__ void copy_rows_kernel(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int rows, int width) {
  gpu::dependent_enter();
  const int r = blockIdx.y;
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < width; c += gridDim.x * blockDim.x)
    dst[r * dst_ld + c] = src[r * src_ld + c];
}

void copy_rows(float* dst, int64_t dst_ld, const float* src, int64_t src_ld, int rows, int width, cudaStream_t stream) {
  OPS_CHECK(rows >= 0 && rows <= 65535 && width >= 0, "copy_rows: %d rows of %d", rows, width);
  if (int64_t(rows) * width == 0) return;
  gpu::launch(copy_rows_kernel, dim3(blocks_for(width, 256), rows), 256, 0, stream, dst, dst_ld, src, src_ld, rows,
              width);
  DSV4_CUDA_LAUNCHED();
}

__global__ void copy_spans_kernel(const CopySpan* spans, int n_spans) {
  gpu::dependent_enter();
  const CopySpan s = spans[blockIdx.y];
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < s.count; i += int64_t(gridDim.x) * blockDim.x)
    s.dst[i] = s.src[i];
}

void copy_spans(const CopySpan* spans, int n_spans, cudaStream_t stream) {
  if (n_spans == 0) return;
  OPS_CHECK(n_spans <= 65535, "copy_spans: %d spans in one launch", n_spans);
  gpu::launch(copy_spans_kernel, dim3(16, unsigned(n_spans)), 256, 0, stream, spans, n_spans);
  DSV4_CUDA_LAUNCHED();
}

void fill_f32(float* x, int64_t n, float value, cudaStream_t stream) {
  if (n == 0) return;
  gpu::launch(fill_kernel, std::min(blocks_for(n, 256), 1024), 256, 0, stream, x, n, value);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4::gpu
