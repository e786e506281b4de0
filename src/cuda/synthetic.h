// SPDX-License-Identifier: MIT
// Random weights in gemv()'s encodings, made on the device, for benchmark models (dsv4 bench): the bytes a real
// checkpoint would have, values meaningless. Decoded magnitudes are about 1/sqrt(k), so activations stay finite
// through many layers.
//   BF16       uniform in ±1/sqrt(k)
//   FP8_BLOCK  e4m3 codes of |v| in [1, 2) with a random sign, e8m0 block scale 2^round(log2(1/sqrt(k)))
//   MXFP4      random e2m1 nibbles, e8m0 scale 2^round(log2(1/(3 sqrt(k)))) per 32
//   NVFP4      random e2m1 nibbles, e4m3 scale ≈ 1/(3 sqrt(k)) per 16; weight_scale_2 = 1
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemv.h"

namespace dsv4 {

// Fills w (gemv_weight_bytes) and scale (gemv_scale_bytes; unused for BF16) of an [n, k] weight. FP8 scales e8m0.
void fill_synthetic_weight(GemvWeight format, void* w, void* scale, int64_t n, int64_t k, uint64_t seed,
                           cudaStream_t stream);

}  // namespace dsv4
