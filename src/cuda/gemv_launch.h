// SPDX-License-Identifier: MIT
// Internal boundary between gemv.cpp (validation, heuristics, errors) and gemv.cu (kernels).
#pragma once
#include <cuda_runtime.h>

#include "cuda/gemv.h"

namespace dsv4::detail {

constexpr int kGemvWarps = 8;  // warps per block; split_k of them share one 16-row tile

// Launches the kernel for validated params with a concrete split_k; returns cudaGetLastError().
cudaError_t gemv_launch(const GemvParams& p, int split_k);
cudaError_t gemv_batched_launch(const GemvBatchedParams& p, int split_k);
cudaError_t gemv_grouped_launch(const GemvGroupedParams& p, int split_k);
cudaError_t moe_slots_launch(const MoeSlotsParams& p);

}  // namespace dsv4::detail
