// SPDX-License-Identifier: MIT
// Host side of the skinny GEMM: argument checks (messages name the field and what was expected), the split-k
// heuristic, and error reporting. The kernels are in gemv.cu.
#include "cuda/gemv.h"

#include <algorithm>
#include <cstdint>

#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/gemv_launch.h"

namespace dsv4 {
namespace {

int k_multiple(GemvWeight w) {
  switch (w) {
    case GemvWeight::BF16: return 8;
    case GemvWeight::FP8_BLOCK: return 16;
    case GemvWeight::MXFP4:
    case GemvWeight::NVFP4: return 32;
  }
  return 1;
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

const char* gemv_weight_name(GemvWeight w) {
  switch (w) {
    case GemvWeight::BF16: return "bf16";
    case GemvWeight::FP8_BLOCK: return "fp8_block";
    case GemvWeight::MXFP4: return "mxfp4";
    case GemvWeight::NVFP4: return "nvfp4";
  }
  return "?";
}

int gemv_default_split_k(const GemvParams& p, int sm_count) {
  // From the split sweep of dsv4_gemv_bench (docs/perf.md): a warp wants at least 16 chunks of k to itself
  // (4 load groups; 64 when m > 16, where each chunk carries more arithmetic), then the grid wants at least one
  // block per multiprocessor, and no warp may be left without a chunk.
  const int64_t tiles = (int64_t(p.n) + 15) / 16;
  const int per_chunk = p.weight == GemvWeight::BF16 ? 32 : p.weight == GemvWeight::FP8_BLOCK ? 64 : 128;
  const int n_chunks = (p.k + per_chunk - 1) / per_chunk;
  const int min_chunks_per_warp = p.m > 16 ? 64 : 16;
  auto blocks = [&](int split) { return (tiles * split + detail::kGemvWarps - 1) / detail::kGemvWarps; };
  int split = detail::kGemvWarps;
  while (split > 1 && n_chunks < min_chunks_per_warp * split) split /= 2;
  while (split < detail::kGemvWarps && blocks(split) < sm_count) split *= 2;
  while (split > 1 && n_chunks < split) split /= 2;
  return split;
}

void gemv(const GemvParams& p) {
  const char* fmt_name = gemv_weight_name(p.weight);
  DSV4_CHECK(p.m >= 0 && p.m <= kGemvMaxM, "gemv: m = {} is outside [0, {}]", p.m, kGemvMaxM);
  DSV4_CHECK(p.n >= 0 && p.k > 0, "gemv: expected n >= 0 and k > 0, got n = {}, k = {}", p.n, p.k);
  DSV4_CHECK(p.k % k_multiple(p.weight) == 0, "gemv ({}): k = {} must be a multiple of {}", fmt_name, p.k,
             k_multiple(p.weight));
  if (p.m == 0 || p.n == 0) return;
  DSV4_CHECK(p.x && p.w && p.y, "gemv ({}): x, w and y must be device pointers, got x={} w={} y={}", fmt_name, p.x,
             p.w, p.y);
  DSV4_CHECK(p.weight == GemvWeight::BF16 || p.w_scale, "gemv ({}): w_scale is required", fmt_name);
  DSV4_CHECK(aligned(p.x, 16) && aligned(p.w, 16), "gemv ({}): x and w must be 16-byte aligned", fmt_name);
  DSV4_CHECK(p.weight != GemvWeight::NVFP4 || aligned(p.w_scale, 2), "gemv (nvfp4): w_scale must be 2-byte aligned");
  DSV4_CHECK(p.weight != GemvWeight::FP8_BLOCK || p.fp8_scale != GemvScale::F32 || aligned(p.w_scale, 4),
             "gemv (fp8_block): f32 w_scale must be 4-byte aligned");
  DSV4_CHECK(p.split_k == 0 || p.split_k == 1 || p.split_k == 2 || p.split_k == 4 || p.split_k == 8,
             "gemv: split_k = {} must be 0 (auto), 1, 2, 4 or 8", p.split_k);
  const int split = p.split_k ? p.split_k : gemv_default_split_k(p, current_sm_count());
  DSV4_CUDA_CHECK(detail::gemv_launch(p, split));
}

}  // namespace dsv4
