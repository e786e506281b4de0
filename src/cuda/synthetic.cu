// SPDX-License-Identifier: MIT
#include "cuda/synthetic.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>

#include "cuda/ops_common.cuh"

namespace dsv4 {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64 finaliser: a counter-based generator
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// One thread per 8 bytes of weights.
__global__ void fill_words_kernel(GemvWeight format, uint64_t* w, int64_t words, float amplitude, uint64_t seed) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= words) return;
  uint64_t r = mix64(seed ^ (uint64_t(i) * 0x2545f4914f6cdd1dull));
  if (format == GemvWeight::BF16) {
    uint64_t out = 0;
    for (int j = 0; j < 4; ++j) {
      const float u = (float((r >> (16 * j)) & 0xffff) / 65535.0f * 2.0f - 1.0f) * amplitude;
      out |= uint64_t(__bfloat16_as_ushort(__float2bfloat16_rn(u))) << (16 * j);
    }
    w[i] = out;
  } else if (format == GemvWeight::FP8_BLOCK) {  // sign | exponent 7 (bias 7: 1.x) | random mantissa
    uint64_t out = 0;
    for (int j = 0; j < 8; ++j) {
      const uint64_t bits = (r >> (8 * j)) & 0xff;
      out |= ((bits & 0x87) | 0x38) << (8 * j);
    }
    w[i] = out;
  } else {
    w[i] = r;  // every e2m1 nibble is a finite value
  }
}

__global__ void fill_bytes_kernel(uint8_t* s, int64_t n, uint8_t value) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) s[i] = value;
}

int blocks(int64_t n) { return int((n + 255) / 256); }

}  // namespace

void fill_synthetic_weight(GemvWeight format, void* w, void* scale, int64_t n, int64_t k, uint64_t seed,
                           cudaStream_t stream) {
  const int64_t bytes = gemv_weight_bytes(format, n, k);
  OPS_CHECK(bytes % 8 == 0, "fill_synthetic_weight: %s weight [%lld, %lld] is not a whole number of 8-byte words",
            gemv_weight_name(format), (long long)n, (long long)k);
  const float amplitude = 1.0f / std::sqrt(float(k));
  fill_words_kernel<<<blocks(bytes / 8), 256, 0, stream>>>(format, static_cast<uint64_t*>(w), bytes / 8, amplitude,
                                                           seed);
  DSV4_CUDA_LAUNCHED();
  const int64_t scale_bytes = gemv_scale_bytes(format, n, k);
  if (scale_bytes == 0) return;
  uint8_t value = 0;
  if (format == GemvWeight::NVFP4) {
    value = __nv_cvt_float_to_fp8(amplitude / 3.0f, __NV_SATFINITE, __NV_E4M3);
  } else {
    const float target = format == GemvWeight::FP8_BLOCK ? amplitude : amplitude / 3.0f;
    value = uint8_t(127 + int(std::lround(std::log2(target))));
  }
  fill_bytes_kernel<<<blocks(scale_bytes), 256, 0, stream>>>(static_cast<uint8_t*>(scale), scale_bytes, value);
  DSV4_CUDA_LAUNCHED();
}

}  // namespace dsv4
