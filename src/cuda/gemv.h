// SPDX-License-Identifier: MIT
// Decode-batch GEMM ("skinny GEMM") with compressed weights:  y[m, n] = sum_k x[m, k] * W[n, k]   (gemm_nt)
// for m = 1..64. Weights stay in their checkpoint layout in GPU memory and are decoded to bf16 in registers;
// products and sums run on the tensor cores (mma.sync bf16, fp32 accumulate), so each weight byte is read once
// per launch for all m rows, and the kernel runs at memory bandwidth for small m.
//
// Contract
//   x  [m, k] bf16, row-major, contiguous (row stride k).
//   W  by format (row-major [n, ...], rows contiguous, base 16-byte aligned):
//     BF16       w [n, k] bf16                                               W = w
//     FP8_BLOCK  w [n, k] e4m3, w_scale [ceil(n/128), ceil(k/128)] e8m0 or f32 (fp8_scale)
//                                                                            W = e4m3(w) * scale[n/128, k/128]
//     MXFP4      w [n, k/2] packed e2m1 (low nibble = element 2j), w_scale [n, k/32] e8m0
//                                                                            W = e2m1 * 2^(E - 127)
//     NVFP4      w [n, k/2] packed e2m1, w_scale [n, k/16] e4m3, w_scale_2 fp32 scalar
//                                                                            W = e2m1 * e4m3(scale) * w_scale_2
//   y  [m, n] fp32 or bf16 (round to nearest even), contiguous (row stride n). Every element is written.
//   k: multiple of 8 (BF16), 16 (FP8_BLOCK), 32 (MXFP4, NVFP4). m in [0, 64]; m == 0 or n == 0 is a no-op.
// Numerics: W decodes exactly to bf16 (see dequant.cuh for the scale ranges), bf16 x bf16 products are exact,
// accumulation is fp32 in an unspecified order (tensor-core sums, then a split-k sum across warps).
// The kernel is asynchronous on `stream`; launch errors are thrown as dsv4::Error.
#pragma once
#include <cuda_runtime.h>

namespace dsv4 {

enum class GemvWeight { BF16, FP8_BLOCK, MXFP4, NVFP4 };
enum class GemvScale { E8M0, F32 };  // element type of the FP8_BLOCK scale tensor
enum class GemvOut { F32, BF16 };

constexpr int kGemvMaxM = 64;

struct GemvParams {
  int m = 0, n = 0, k = 0;
  const void* x = nullptr;        // [m, k] bf16
  const void* w = nullptr;        // see the table above
  const void* w_scale = nullptr;  // see the table above; nullptr for BF16
  float w_scale_2 = 1.0f;         // NVFP4 weight_scale_2 (the loader reads the scalar once); ignored otherwise
  void* y = nullptr;              // [m, n] of `out`
  GemvWeight weight = GemvWeight::BF16;
  GemvScale fp8_scale = GemvScale::E8M0;
  GemvOut out = GemvOut::F32;
  int split_k = 0;  // warps sharing one 16-row tile (1, 2, 4 or 8); 0 = chosen from the shape (benchmarks set it)
  cudaStream_t stream = nullptr;
};

void gemv(const GemvParams& p);

// The split_k that gemv() chooses for p on a device with sm_count multiprocessors.
int gemv_default_split_k(const GemvParams& p, int sm_count);

const char* gemv_weight_name(GemvWeight w);

}  // namespace dsv4
