// SPDX-License-Identifier: MIT
// linear_f32's decode-sized block (contract in ops.h), shared by its own kernel (ops_rows.cu) and the MoE gate kernel
// that routes after it (moe_gate.cu), so both compute the router logits with the same sums.
#pragma once
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/ops.h"
#include "cuda/ops_common.cuh"

namespace dsv4::gpu::detail {

// Block (column c, k-slice s, row group g) computes the partial dot products of rows g·kRows.. with W row c over
// slice s. Every thread issues kLinearUnroll loads of W (and of each x row) before it adds, so a slice of
// kLinearThreads · kLinearUnroll vectors is one round trip. When the grid would be small (decode: m·n of a few
// dozen) k is split into up to 8 slices whose blocks form one thread-block cluster: rank 0 adds the slices'
// partials from distributed shared memory in rank order, so the result is deterministic without a scratch
// buffer or atomics.

constexpr int kLinearThreads = 256;
constexpr int kLinearUnroll = 4;
constexpr int kLinearMaxSlices = 8;           // the portable cluster size
constexpr int kLinearMinSliceFloats = 2048;   // >= 8 values per thread, or a slice is not worth its block

template <int kVec>
struct LinearVec;
template <>
struct LinearVec<1> {
  using T = float;
};
template <>
struct LinearVec<4> {
  using T = float4;
};

__device__ __forceinline__ float dot_acc(float a, float b, float acc) { return fmaf(a, b, acc); }
__device__ __forceinline__ float dot_acc(float4 a, float4 b, float acc) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Blocks of rows per launch: 4 rows per block from m = 4.
inline int linear_f32_rows_per_block(int m) { return m >= 4 ? 4 : 1; }

// Split k while the grid stays under ~2 blocks per SM and each slice keeps >= kLinearMinSliceFloats values.
inline int linear_f32_slices(const LinearF32Params& p, int sm_count) {
  const int rows_per_block = linear_f32_rows_per_block(p.m);
  const int64_t row_groups = (p.m + rows_per_block - 1) / rows_per_block;
  const int64_t blocks = int64_t(p.n) * row_groups, target = 2 * int64_t(sm_count);
  int slices = 1;
  while (slices < kLinearMaxSlices && blocks * slices * 2 <= target &&
         int64_t(p.k) >= int64_t(slices) * 2 * kLinearMinSliceFloats)
    slices *= 2;
  return slices;
}

// One block of linear_f32 (every thread of the block calls it; it ends with the block's outputs stored). early
// (gpu::early_weights): the first round of W loads goes out before the wait for the previous kernel.
template <int kRows, int kVec, bool kCluster>
__device__ __forceinline__ void linear_f32_block(const LinearF32Params& p, int slices, bool early) {
  gpu::allow_dependents();
  gpu::WaitOnce wait;
  if (!early) wait();
  using Vec = typename LinearVec<kVec>::T;
  __shared__ float warp_partial[kRows][kLinearThreads / 32];
  __shared__ float block_partial[kRows];
  const int col = blockIdx.x / slices, slice = blockIdx.x % slices, row0 = blockIdx.y * kRows;
  const int64_t units = p.k / kVec, per_slice = (units + slices - 1) / slices;
  const int64_t begin = slice * per_slice, end = units < begin + per_slice ? units : begin + per_slice;
  const Vec* w = reinterpret_cast<const Vec*>(p.w + int64_t(col) * p.k);
  const Vec* x[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r)  // rows past m re-read row m - 1 (never stored)
    x[r] = reinterpret_cast<const Vec*>(p.x + int64_t(row0 + r < p.m ? row0 + r : p.m - 1) * p.k);
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
  for (int64_t i = begin + threadIdx.x; i < end; i += kLinearUnroll * kLinearThreads) {
    Vec wv[kLinearUnroll], xv[kRows][kLinearUnroll];
#pragma unroll
    for (int u = 0; u < kLinearUnroll; ++u) {
      const int64_t at = i + u * kLinearThreads;
      wv[u] = at < end ? w[at] : Vec{};
    }
    wait();  // before the first load of x
#pragma unroll
    for (int u = 0; u < kLinearUnroll; ++u) {
      const int64_t at = i + u * kLinearThreads;
#pragma unroll
      for (int r = 0; r < kRows; ++r) xv[r][u] = at < end ? x[r][at] : Vec{};
    }
#pragma unroll
    for (int u = 0; u < kLinearUnroll; ++u)
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r] = dot_acc(xv[r][u], wv[u], acc[r]);
  }

  wait();  // a thread without loads, before the stores
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float s = detail::warp_sum(acc[r]);
    if (lane == 0) warp_partial[r][warp] = s;
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float s = detail::warp_sum(lane < kLinearThreads / 32 ? warp_partial[r][lane] : 0.0f);
      if (lane == 0) {
        if (kCluster) {
          block_partial[r] = s;
        } else if (row0 + r < p.m) {
          p.y[int64_t(row0 + r) * p.n + col] = s * p.scale;
        }
      }
    }
  }
  if constexpr (kCluster) {
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    cluster.sync();  // every slice's partial is in its block's shared memory
    const int r = threadIdx.x;
    if (cluster.block_rank() == 0 && r < kRows && row0 + r < p.m) {
      float total = 0.0f;
      for (int s = 0; s < slices; ++s) total += cluster.map_shared_rank(block_partial, s)[r];
      p.y[int64_t(row0 + r) * p.n + col] = total * p.scale;
    }
    cluster.sync();  // the partials must outlive rank 0's reads
  }
}


}  // namespace dsv4::gpu::detail
