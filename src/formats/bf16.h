// SPDX-License-Identifier: MIT
// bfloat16: the top 16 bits of an IEEE float32. Rounding is round-to-nearest-even, NaN stays NaN.
#pragma once
#include <cstdint>
#include <cstring>

#include "formats/hd.h"

namespace dsv4 {

DSV4_HD float bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
DSV4_HD uint32_t f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

DSV4_HD float bf16_to_f32(uint16_t b) { return bits_to_f32(uint32_t(b) << 16); }

DSV4_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// x rounded to the nearest bf16 value, returned as float.
DSV4_HD float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

DSV4_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_f32(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    float v = float(man) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
}

}  // namespace dsv4
