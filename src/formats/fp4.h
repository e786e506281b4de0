// SPDX-License-Identifier: MIT
// FP4 E2M1 elements (1 sign, 2 exponent, 1 mantissa): magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} for codes 0..7,
// bit 3 = sign. Two codes per byte: low nibble = element 2j, high nibble = element 2j+1 (official DeepSeek FP4
// experts and NVIDIA ModelOpt NVFP4 agree on this).
#pragma once
#include <cmath>
#include <cstdint>

#include "formats/fp8.h"

namespace dsv4 {

constexpr float kE2M1Max = 6.0f;

DSV4_HD float e2m1_to_f32(uint8_t code) {
  const uint8_t m = code & 7;
  const float mag = m < 4 ? 0.5f * float(m) : (m == 4 ? 2.0f : m == 5 ? 3.0f : m == 6 ? 4.0f : 6.0f);
  return (code & 8) ? -mag : mag;
}

// Nearest e2m1 code, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4);
// saturates at +-6.
DSV4_HD uint8_t f32_to_e2m1(float x) {
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  const float a = std::fabs(x);
  uint8_t m;
  if (a <= 0.25f) m = 0;
  else if (a < 0.75f) m = 1;
  else if (a <= 1.25f) m = 2;
  else if (a < 1.75f) m = 3;
  else if (a <= 2.5f) m = 4;
  else if (a < 3.5f) m = 5;
  else if (a <= 5.0f) m = 6;
  else m = 7;
  return sign | m;
}

DSV4_HD float round_e2m1(float x) { return e2m1_to_f32(f32_to_e2m1(x)); }

// The power-of-two scale of one FP4 block (DeepSeek fp4 act_quant): s = 2^ceil(log2(max(amax, 6*2^-126)/6)).
DSV4_HD float fp4_block_scale(const float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return pow2_scale(amax, kE2M1Max, kE2M1Max * 1.1754943508222875e-38f);
}

// In-place FP4 simulation of one block: x = e2m1(x/s) * s.
DSV4_HD void fp4_simulate_block(float* x, int n) {
  const float s = fp4_block_scale(x, n);
  for (int i = 0; i < n; ++i) x[i] = round_e2m1(x[i] / s) * s;
}

}  // namespace dsv4
