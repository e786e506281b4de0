// SPDX-License-Identifier: MIT
// Prefill GEMM on the tensor cores with compressed weights:  y[m, n] = sum_k x[m, k] * W[n, k]   (gemm_nt)
// for large m (65 .. 8192+; any m >= 0 works, decode batches of m <= 64 are faster through gemv()).
// Non-bf16 weights are first decoded into a bf16 scratch [n, k] owned by the GemmContext (one coalesced pass over
// the checkpoint bytes), then a cuBLASLt bf16 x bf16 -> fp32-accumulate GEMM runs. Weight formats and layouts are
// exactly those of gemv.h.
//
// Contract
//   x  [m, k] bf16, row-major, row stride ldx (0 = k) elements.
//   W  by format (row-major [n, ...], rows contiguous; identical to gemv.h):
//     BF16       w [n, k] bf16                                               W = w
//     FP8_BLOCK  w [n, k] e4m3, w_scale [ceil(n/128), ceil(k/128)] e8m0 or f32 (fp8_scale)
//                                                                            W = e4m3(w) * scale[n/128, k/128]
//     MXFP4      w [n, k/2] e2m1 in the device layout (as gemv.h), w_scale [n, k/32] e8m0
//                                                                            W = e2m1 * 2^(E - 127)
//     NVFP4      w [n, k/2] e2m1 as MXFP4, w_scale [n, k/16] e4m3, w_scale_2 fp32 scalar
//                                                                            W = e2m1 * e4m3(scale) * w_scale_2
//   layout Tiles: MXFP4 / NVFP4 w and w_scale in 16-row tiles as gemv.h (cuda/weight_tiles.h); n a multiple of 16,
//      k of 128.
//   y  [m, n] fp32 or bf16 (round to nearest even), row stride ldy (0 = n) elements. Every element y[i, 0..n) is
//      written; columns n..ldy of each row are never touched. accumulate = true (fp32 out only): y += x Wᵀ.
//   k: multiple of 8 (BF16), 16 (FP8_BLOCK), 32 (MXFP4, NVFP4). m == 0 or n == 0 is a no-op.
//   Alignment (cuBLASLt's fast paths, checked): x, w and y 16-byte aligned; ldx a multiple of 8 and ldy a
//   multiple of 16 bytes (4 fp32 / 8 bf16 elements); NVFP4 w_scale 2-byte and FP8 f32 w_scale 4-byte aligned.
// Numerics: the decoded bf16 weight equals W exactly for BF16, MXFP4 and FP8_BLOCK with e8m0 scales (within the
// scale ranges of dequant.cuh) and for NVFP4 (the scratch holds e2m1 * e4m3(scale), exact; w_scale_2 is applied to
// the fp32 sums as the GEMM's alpha). FP8_BLOCK with f32 scales is the one rounded decode:
// W = bf16_rn(float(e4m3) * scale), a relative error <= 2^-9 per weight (gemv() instead scales fp32 partial sums).
// bf16 x bf16 products are exact; accumulation is fp32 in cuBLASLt's order.
// Everything is asynchronous on `stream`; argument and cuBLASLt errors are thrown as dsv4::Error.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "cuda/device.h"
#include "cuda/gemv.h"

namespace dsv4 {

struct GemmParams {
  int m = 0, n = 0, k = 0;
  const void* x = nullptr;  // [m, k] bf16, row stride ldx
  int64_t ldx = 0;          // elements; 0 = k
  GemvWeight weight = GemvWeight::BF16;
  const void* w = nullptr;        // see the table above
  const void* w_scale = nullptr;  // see the table above; nullptr for BF16
  float w_scale_2 = 1.0f;         // NVFP4 weight_scale_2; ignored otherwise
  GemvScale fp8_scale = GemvScale::E8M0;
  GemvLayout layout = GemvLayout::Rows;
  void* y = nullptr;  // [m, n] of `out`, row stride ldy
  int64_t ldy = 0;    // elements; 0 = n
  GemvOut out = GemvOut::F32;
  bool accumulate = false;  // y += x Wᵀ (fp32 out only)
  cudaStream_t stream = nullptr;
};

// One weight tensor in its checkpoint layout (the W rows of the table above).
struct WeightDesc {
  int n = 0, k = 0;
  GemvWeight weight = GemvWeight::BF16;
  const void* w = nullptr;
  const void* w_scale = nullptr;
  GemvScale fp8_scale = GemvScale::E8M0;
  GemvLayout layout = GemvLayout::Rows;
};

// Decodes W into out_bf16 [n, k] (row-major, contiguous, 16-byte aligned) on `stream`: bf16 bits of W, except
// NVFP4 where the output is e2m1 * e4m3(scale) without w_scale_2 (exact; the caller applies w_scale_2), and
// FP8_BLOCK with f32 scales, rounded as described above. BF16 weights are copied.
void dequantize_weight_bf16(const WeightDesc& w, uint16_t* out_bf16, cudaStream_t stream);

// Elements of bf16 scratch a GemmContext needs for p (0 for BF16 weights, else n * k).
size_t gemm_scratch_elements(const GemmParams& p);

// Owns the cuBLASLt handle, a 32 MiB cuBLASLt workspace and the bf16 weight scratch, all allocated on the current
// device at construction, so gemm() itself never allocates (safe inside CUDA graph capture once every shape has
// been seen: the first call for a shape queries cuBLASLt's heuristic, which is host-only).
// Not thread-safe, and the scratch and workspace are reused by every call: issue all calls of one context on one
// stream (or otherwise order them), one context per concurrent stream.
class GemmContext {
 public:
  static constexpr size_t kWorkspaceBytes = size_t(32) << 20;

  // max_scratch_elements: the largest n * k of any non-bf16 weight this context will see (throws on more).
  explicit GemmContext(size_t max_scratch_elements);
  ~GemmContext();
  GemmContext(const GemmContext&) = delete;
  GemmContext& operator=(const GemmContext&) = delete;

  void gemm(const GemmParams& p);

  size_t max_scratch_elements() const { return max_scratch_elements_; }
  size_t cached_plans() const;  // distinct shapes seen (tests)

 private:
  struct Plan;
  struct PlanKey {
    int m, n, k;
    int64_t ldx, ldy;
    int out;
    bool accumulate;
    int align_x, align_w, align_y;  // alignment class of the pointers (bytes, 16..256)
    auto operator<=>(const PlanKey&) const = default;
  };
  const Plan& plan_for(const PlanKey& key);

  void* handle_ = nullptr;  // cublasLtHandle_t
  DeviceBuffer workspace_, scratch_;
  size_t max_scratch_elements_ = 0;
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace dsv4

namespace dsv4::detail {
// The decode kernel's launch (dequant_weights.cu); arguments are checked by dequantize_weight_bf16.
cudaError_t dequant_weight_launch(const WeightDesc& w, uint16_t* out_bf16, cudaStream_t stream);
}  // namespace dsv4::detail
