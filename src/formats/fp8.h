// SPDX-License-Identifier: MIT
// FP8 element formats used by DeepSeek-V4 checkpoints and by the simulated KV-cache rounding.
//   e4m3 ("fn" variant): 1 sign, 4 exponent (bias 7), 3 mantissa; no infinities, S.1111.111 = NaN,
//                        max normal 448, min normal 2^-6, subnormals k*2^-9.
//   e5m2:                IEEE-like, bias 15, with inf/NaN.
//   e8m0 (ue8m0 scale):  unsigned exponent byte, value 2^(E-127); 0xFF = NaN.
#pragma once
#include <cmath>
#include <cstdint>

#include "formats/bf16.h"

namespace dsv4 {

constexpr float kE4M3Max = 448.0f;

DSV4_HD float e4m3_to_f32(uint8_t v) {
  const uint32_t sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 0x7;
  float mag;
  if (exp == 0xf && man == 0x7) {
    mag = NAN;
  } else if (exp == 0) {
    mag = float(man) * 0.001953125f;  // man * 2^-9
  } else {
    mag = bits_to_f32(((exp + 120) << 23) | (man << 20));
  }
  return sign ? -mag : mag;
}

DSV4_HD float e5m2_to_f32(uint8_t v) { return f16_to_f32(uint16_t(v) << 8); }

DSV4_HD float e8m0_to_f32(uint8_t e) {
  if (e == 0xff) return NAN;
  if (e == 0) return 5.877471754111438e-39f;  // 2^-127 (float32 subnormal)
  return bits_to_f32(uint32_t(e) << 23);
}

// Round to the nearest e4m3 value (ties to even), saturating at +-448. NaN stays NaN.
DSV4_HD float round_e4m3(float x) {
  if (std::isnan(x)) return x;
  const float a = std::fabs(x);
  if (a >= kE4M3Max) return std::copysign(kE4M3Max, x);
  if (a == 0.0f) return x;
  int e;
  std::frexp(a, &e);                                // a = m * 2^e, m in [0.5, 1)
  const int exp_unbiased = e - 1 < -6 ? -6 : e - 1;  // subnormals share the quantum of 2^-6
  const float quantum = std::ldexp(1.0f, exp_unbiased - 3);
  const float r = std::nearbyint(a / quantum) * quantum;  // current rounding mode: nearest-even
  return std::copysign(r > kE4M3Max ? kE4M3Max : r, x);
}

// Encode to the e4m3 byte (after rounding); used by writers and tests.
DSV4_HD uint8_t f32_to_e4m3(float x) {
  const float r = round_e4m3(x);
  if (std::isnan(r)) return 0x7f;
  const uint8_t sign = std::signbit(r) ? 0x80 : 0;
  const float a = std::fabs(r);
  if (a < 0.015625f) return sign | uint8_t(a * 512.0f);  // subnormal: a / 2^-9
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e
  const uint8_t exp = uint8_t(e - 1 + 7), man = uint8_t((m * 2.0f - 1.0f) * 8.0f);
  return sign | uint8_t(exp << 3) | man;
}

// Smallest power of two s with amax / s <= fmax, with amax floored at `floor` (DeepSeek's ue8m0 block scale).
DSV4_HD float pow2_scale(float amax, float fmax, float floor_value) {
  const float a = amax > floor_value ? amax : floor_value;
  return std::exp2(std::ceil(std::log2(a / fmax)));
}

// The power-of-two scale of one FP8 block (DeepSeek act_quant with ue8m0 scale, |max| floored at 1e-4).
DSV4_HD float fp8_block_scale(const float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  return pow2_scale(amax, kE4M3Max, 1e-4f);
}

// In-place FP8 simulation of one block: x = e4m3(x/s) * s.
DSV4_HD void fp8_simulate_block(float* x, int n) {
  const float s = fp8_block_scale(x, n);
  for (int i = 0; i < n; ++i) x[i] = round_e4m3(x[i] / s) * s;
}

}  // namespace dsv4
