// SPDX-License-Identifier: MIT
// Device helpers shared by the ops_*.cu kernels (reductions, bf16 unpacking, launch error checks).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include <cstdio>

#include "formats/bf16.h"

namespace dsv4::gpu::detail {

// Whether this block is the last of `blocks` to arrive at *ticket (0 before the launch; the last block resets it
// for the next one). Every block's global stores before the call are visible to the last block after it. Called by
// every thread of the block, once per launch.
__device__ __forceinline__ bool last_block_to_arrive(uint32_t* ticket, unsigned blocks) {
  __shared__ bool last;
  __threadfence();  // this block's stores, before its ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(ticket, 1u) == blocks - 1;
    if (last) *ticket = 0;  // every other block has taken its ticket
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Sum over the warp, every lane gets it (float, double; unsigned long long: exact).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double partial[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // partial may still be read by a previous call
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  double total = 0;
  for (int w = 0; w < n_warps; ++w) total += partial[w];
  return total;
}

// Eight bf16 values of a 16-byte word as floats (element 0 in the low half of word 0).
__device__ __forceinline__ void unpack_bf16x8(const uint4& w, float* out) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

inline int blocks_for(int64_t n, int threads) { return int((n + threads - 1) / threads); }

// Throws dsv4::Error with `message` (ops_errors.cpp: fmt and core/check.h stay out of nvcc's way).
[[noreturn]] void throw_error(const char* message);
// Throws naming the kernel when the last launch failed.
void check_launch(const char* kernel);

}  // namespace dsv4::gpu::detail

// OPS_CHECK(cond, "printf format", args...): argument check of a launcher, thrown as dsv4::Error.
#define OPS_CHECK(cond, ...)                                      \
  do {                                                            \
    if (!(cond)) {                                                \
      char ops_msg_[256];                                         \
      std::snprintf(ops_msg_, sizeof ops_msg_, __VA_ARGS__);      \
      ::dsv4::gpu::detail::throw_error(ops_msg_);                 \
    }                                                             \
  } while (0)

namespace dsv4::gpu::detail {

}  // namespace dsv4::gpu::detail

#define DSV4_CUDA_LAUNCHED() ::dsv4::gpu::detail::check_launch(__func__)
