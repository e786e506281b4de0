// SPDX-License-Identifier: MIT
// Block-scaled weight formats of the official DeepSeek-V4 release (docs/formats.md). Plain element maps shared
// by the CPU loader, the quantiser and (later) CUDA kernels; no allocation, no engine types.
//
//   FP8 block (all F8_E4M3 linears): W[o, i] = e4m3(Wq[o, i]) * S[o / 128, i / 128], S of shape
//       [ceil(O/128), ceil(I/128)]: e8m0 bytes (value 2^(E-127)) in the release, F32 in some repackagings.
//   MXFP4-like experts (I8 [O, I/2] + F8_E8M0 [O, I/32]): W[o, i] = e2m1(nibble(o, i)) * 2^(E[o, i/32] - 127),
//       nibble(o, 2j) = low 4 bits of byte (o, j), nibble(o, 2j+1) = high 4 bits.
#pragma once
#include <cmath>
#include <cstdint>

#include "formats/fp4.h"
#include "formats/fp8.h"

namespace dsv4 {

constexpr int kFp8BlockSize = 128;   // square weight tile sharing one scale
constexpr int kMxfp4GroupSize = 32;  // elements along K sharing one e8m0 scale

DSV4_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Element i (along K) of a packed FP4 row: two codes per byte, low nibble first.
DSV4_HD uint8_t fp4_code_at(const uint8_t* packed_row, int64_t i) {
  const uint8_t byte = packed_row[i >> 1];
  return (i & 1) ? uint8_t(byte >> 4) : uint8_t(byte & 0x0f);
}

DSV4_HD uint8_t pack_fp4_pair(uint8_t even_code, uint8_t odd_code) {
  return uint8_t((odd_code & 0x0f) << 4 | (even_code & 0x0f));
}

// Power-of-two scale for a block whose |max| is amax, as DeepSeek quantises weights: the smallest 2^k with
// amax / 2^k <= fmax, returned as its e8m0 byte (k + 127), clamped to the finite e8m0 range [0, 254].
// An all-zero block gets 2^-127 (byte 0), so its codes are all zero.
DSV4_HD uint8_t e8m0_scale_for(float amax, float fmax) {
  if (!(amax > 0.0f)) return 0;
  int k = int(std::ceil(std::log2(amax / fmax)));
  if (std::exp2(float(k)) * fmax < amax) ++k;           // log2 rounding near exact powers of two
  else if (std::exp2(float(k - 1)) * fmax >= amax) --k;
  k += 127;
  return uint8_t(k < 0 ? 0 : (k > 254 ? 254 : k));
}

}  // namespace dsv4
