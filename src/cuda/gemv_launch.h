// SPDX-License-Identifier: MIT
// Internal boundary between gemv.cpp (validation, heuristics, errors) and gemv.cu (kernels).
#pragma once
#include <cuda_runtime.h>

#include "cuda/gemv.h"

namespace dsv4::detail {

constexpr int kGemvWarps = 8;  // warps per block; split_k of them share one 16-row tile

// Chunks (64 bytes of each of a warp's 16 rows) per register group; two groups are in flight (double buffering).
// Chosen from ptxas reports so that no variant spills: fp4 decodes need more registers, more n-tiles more again.
constexpr int gemv_unroll(bool fp4, int n_tiles) { return n_tiles > 1 ? 2 : fp4 ? 3 : 4; }

// Launches the kernel for validated params with a concrete split_k; returns cudaGetLastError().
cudaError_t gemv_launch(const GemvParams& p, int split_k);

}  // namespace dsv4::detail
