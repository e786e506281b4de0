// SPDX-License-Identifier: MIT
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda/dequant.cuh"
#include "cuda/fp4_layout.h"
#include "dequant_probe.h"

namespace dsv4::probe {
namespace {

enum class Kind { E4M3, MXFP4, NVFP4 };

// One thread decodes one 32-bit word of codes: for e4m3 4 codes, for e2m1 4 bytes (8 codes, device layout).
__global__ void decode_kernel(Kind kind, uint32_t scale, const uint32_t* words, uint32_t* out, int n_words) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n_words) return;
  if (kind == Kind::E4M3) {
    dq::e4m3x4_to_bf16x2(words[i], dq::fp8_factor_e8m0(scale), out + 2 * i);
  } else {
    const uint32_t f = kind == Kind::MXFP4 ? dq::mxfp4_factor(scale) : dq::nvfp4_factor(scale);
    dq::e2m1x8_to_bf16x2(words[i], f, out + 4 * i);
  }
}

__global__ void factor_kernel(uint32_t* out) {
  const uint32_t s = threadIdx.x;
  out[s] = dq::nvfp4_factor(s);
  dq::nvfp4_factor_pair(s | (255u - s) << 8, out[256 + s], out[512 + s]);
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e));
}

std::vector<uint16_t> run(Kind kind, uint32_t scale) {
  std::vector<uint32_t> words(64);  // bytes 0..255 in order
  for (int i = 0; i < 64; ++i)
    words[i] = uint32_t(4 * i) | uint32_t(4 * i + 1) << 8 | uint32_t(4 * i + 2) << 16 | uint32_t(4 * i + 3) << 24;
  if (kind != Kind::E4M3)  // e2m1 words go to the kernels in the device layout; the results are in element order
    for (uint32_t& w : words) w = fp4_layout::to_device(w);
  const int out_words = kind == Kind::E4M3 ? 128 : 256;
  uint32_t *d_in = nullptr, *d_out = nullptr;
  check(cudaMalloc(&d_in, 64 * 4), "cudaMalloc");
  check(cudaMalloc(&d_out, out_words * 4), "cudaMalloc");
  check(cudaMemcpy(d_in, words.data(), 64 * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  decode_kernel<<<1, 64>>>(kind, scale, d_in, d_out, 64);
  check(cudaGetLastError(), "decode_kernel launch");
  std::vector<uint16_t> out(size_t(out_words) * 2);
  check(cudaMemcpy(out.data(), d_out, out_words * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(d_in);
  cudaFree(d_out);
  return out;
}

}  // namespace

std::vector<uint32_t> nvfp4_factors_both_ways() {
  uint32_t* d_out = nullptr;
  check(cudaMalloc(&d_out, 3 * 256 * 4), "cudaMalloc");
  factor_kernel<<<1, 256>>>(d_out);
  check(cudaGetLastError(), "factor_kernel launch");
  std::vector<uint32_t> out(3 * 256);
  check(cudaMemcpy(out.data(), d_out, out.size() * 4, cudaMemcpyDeviceToHost), "cudaMemcpy");
  cudaFree(d_out);
  return out;
}

std::vector<uint16_t> decode_e4m3_codes(uint8_t e8m0) { return run(Kind::E4M3, e8m0); }
std::vector<uint16_t> decode_e2m1_bytes_mx(uint8_t e8m0) { return run(Kind::MXFP4, e8m0); }
std::vector<uint16_t> decode_e2m1_bytes_nv(uint8_t e4m3_scale) { return run(Kind::NVFP4, e4m3_scale); }

}  // namespace dsv4::probe
