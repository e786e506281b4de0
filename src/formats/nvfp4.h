// SPDX-License-Identifier: MIT
// NVIDIA NVFP4 (ModelOpt layout, docs/formats.md): per linear
//   weight         U8  [O, I/2]   two E2M1 codes per byte, low nibble = even element
//   weight_scale   F8_E4M3 [O, I/16]  per-16-element block scale
//   weight_scale_2 F32 scalar     per-tensor ("global") scale
//   W[o, i] = e2m1(code(o, i)) * e4m3(weight_scale[o, i/16]) * weight_scale_2
// Quantisation follows ModelOpt's NVFP4QTensor exactly (same formulas, same fp32 operation order, same ties):
//   weight_scale_2 = amax(W) / (6 * 448)
//   block scale    = e4m3(block_amax / (6 * weight_scale_2)), 1.0 where block_amax == 0
//   code           = e2m1(W / (block scale * weight_scale_2)), ties to the even code, saturating at 6,
//                    sign bit set only for W < 0 (so +-0 -> code 0).
// Activations: the NVFP4 activation global scale is amax(x) / (6 * 448) of the activation at run time; a
// checkpoint's input_scale (calibrated amax / 2688) is never used for it.
#pragma once
#include <cmath>
#include <cstdint>

#include "formats/fp4.h"
#include "formats/fp8.h"

namespace dsv4 {

constexpr int kNvfp4GroupSize = 16;
constexpr float kNvfp4GlobalDivisor = kE2M1Max * kE4M3Max;  // 6 * 448 = 2688

// Per-tensor scale from the tensor's (or the activation's) absolute maximum.
DSV4_HD float nvfp4_global_scale(float amax) { return amax / kNvfp4GlobalDivisor; }

// The e4m3 byte of one 16-block's scale.
DSV4_HD uint8_t nvfp4_block_scale_code(float block_amax, float global_scale) {
  float s = block_amax / (kE2M1Max * global_scale);
  if (s == 0.0f) s = 1.0f;
  return f32_to_e4m3(s);
}

// E2M1 code of x given the block's decoded e4m3 scale (as float) and the global scale.
DSV4_HD uint8_t nvfp4_encode(float x, float block_scale, float global_scale) {
  const float scaled = x / (block_scale * global_scale);
  const uint8_t code = f32_to_e2m1(scaled);
  return scaled < 0.0f ? code : uint8_t(code & 7);  // ModelOpt takes the sign from x < 0: -0.0 -> +0
}

DSV4_HD float nvfp4_decode(uint8_t code, float block_scale, float global_scale) {
  return e2m1_to_f32(code) * (block_scale * global_scale);
}

}  // namespace dsv4
