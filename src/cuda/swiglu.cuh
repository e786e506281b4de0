// SPDX-License-Identifier: MIT
// One element of the experts' SwiGLU (gpu::swiglu, ops.h 4.2), shared by its own kernel and the grouped w1 + w3
// kernels that compute it themselves (gemv.cu's last block per slot, gemv_wgmma.cu's paired tiles), so that every
// path gives the same bits.
#pragma once
#include <cstdint>

#include "formats/bf16.h"

namespace dsv4::detail {

// bf16(silu(min(gate, limit)) · clamp(up, ±limit) · weight); limit 0 = no clamp.
__device__ __forceinline__ uint16_t swiglu_bf16(float gate, float up, float limit, float weight) {
  if (limit > 0) {  // gate clamped from above only, up on both sides
    gate = fminf(gate, limit);
    up = fminf(fmaxf(up, -limit), limit);
  }
  return f32_to_bf16(gate / (1.0f + expf(-gate)) * up * weight);
}

}  // namespace dsv4::detail
