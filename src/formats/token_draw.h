// SPDX-License-Identifier: MIT
// The draw contract: how one token is drawn from a row of next-token logits, defined once for the host Sampler
// (model/sampler.h) and the CUDA kernel (cuda/ops.h draw_tokens), which give the same id for the same row and u.
//
//   greedy (temperature 0): the highest logit, the lowest id among equal ones.
//   weights    w_i = draw_weight(l_i, max, 1/T): exp((l_i - max) / T) in fixed point, units of 2^-40 (the best id
//              weighs 2^40, ids below e^-28 weigh 0), computed with float operations that round the same way on
//              both sides (no fma, no library call), so every sum below is an exact integer in any order.
//   "before"   higher logit first, lower id among equal logits (-0 and +0 are equal).
//   cut        the first top_k ids in "before" order (all when top_k is 0 or >= vocab); then, when top_p < 1, the
//              shortest prefix of those whose weight reaches nucleus_target(top_p, their total). A cut is a prefix,
//              so it is "every id up to a pivot id".
//   draw       r = draw_point(u, W) with W the cut's total weight: the token is the lowest id j of the cut whose
//              running sum in id order, over the cut's ids <= j, exceeds r.
// Logits are finite or -inf; a row whose maximum is not finite is drawn greedily.
#pragma once
#include <cmath>
#include <cstdint>

#include "formats/bf16.h"
#include "formats/float_key.h"

namespace dsv4 {

// What one drawn token needs besides its logits: a plain struct the host fills and a kernel reads.
struct TokenDraw {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;        // in (0, 1]
  int32_t top_k = 0;         // 0: no limit
  int32_t vocab = 0;         // draw among ids [0, vocab) of the row (the tokenizer may know fewer ids than the model)
  double u = 0.0;            // uniform in [0, 1), from the sampler's generator
};

constexpr int kDrawWeightBits = 40;

namespace draw_detail {
// Single float operations, rounded to nearest on both sides: the device never fuses them (the _rn intrinsics), the
// host never does either (the project builds with -ffp-contract=off).
DSV4_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
DSV4_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DSV4_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
}  // namespace draw_detail

// exp(x) for x <= 0 in units of 2^-40, rounded to the nearest integer and held in a float (exact: an integer
// below 2^41): 2^40 at x = 0, 0 below x ~ -28.4. e^x = 2^n · e^y with n = rint(x / ln 2) and |y| <= ln 2 / 2, e^y
// by its degree-6 Taylor polynomial (relative error < 2e-7; the rounding of x / ln 2 adds up to 3e-6 at x = -28).
// Branch-free (selects only), so the host loop over a vocabulary vectorises.
DSV4_HD float draw_weight_value(float x) {
  using namespace draw_detail;
  x = x > -32.0f ? x : -32.0f;  // also NaN; e^-32 · 2^40 rounds to 0 below
  x = x < 0.0f ? x : 0.0f;
  const float t = mul(x, 1.44269504f);  // x / ln 2
  // Adding and removing 1.5 · 2^23 rounds to an integer (half to even): no library call on either side.
  const float n = sub(add(t, 12582912.0f), 12582912.0f);
  const float y = mul(sub(t, n), 0.693147182f);
  float p = 1.0f / 720.0f;
  p = add(mul(p, y), 1.0f / 120.0f);
  p = add(mul(p, y), 1.0f / 24.0f);
  p = add(mul(p, y), 1.0f / 6.0f);
  p = add(mul(p, y), 0.5f);
  p = add(mul(p, y), 1.0f);
  p = add(mul(p, y), 1.0f);
  // p · 2^e, exact (a power of two; e = n + 40 is in [-7, 40]); below e = -1 it is under 1.5 / 4 and rounds to 0.
  const float v = mul(p, bits_to_f32(uint32_t(int(n) + kDrawWeightBits + 127) << 23));
  // Floats from 2^23 up are integers; below, adding and removing 2^23 rounds to one (half to even).
  const float rounded = sub(add(v, 8388608.0f), 8388608.0f);
  return v < 8388608.0f ? rounded : v;
}
DSV4_HD uint64_t draw_weight_of(float x) { return uint64_t(int64_t(draw_weight_value(x))); }

// The weight of a logit given the row's maximum and 1 / temperature (1.0f / T, correctly rounded on both sides).
DSV4_HD uint64_t draw_weight(float logit, float max, float inv_temperature) {
  return draw_weight_of(draw_detail::mul(draw_detail::sub(logit, max), inv_temperature));
}

// The nucleus reaches top_p of `total` when its weight is at least ceil(top_p · total) (within [1, total]).
DSV4_HD uint64_t nucleus_target(float top_p, uint64_t total) {
#if defined(__CUDA_ARCH__)
  const double t = ceil(__dmul_rn(double(top_p), double(total)));
#else
  const double t = std::ceil(double(top_p) * double(total));
#endif
  if (!(t >= 1.0)) return total > 0 ? 1 : 0;
  const uint64_t target = t >= 18446744073709549568.0 ? total : uint64_t(t);
  return target < total ? target : total;
}

// The point u ∈ [0, 1) picks in a total weight: floor(u · total), at most total - 1.
DSV4_HD uint64_t draw_point(double u, uint64_t total) {
  if (total == 0) return 0;
#if defined(__CUDA_ARCH__)
  const double x = __dmul_rn(u, double(total));
#else
  const double x = u * double(total);
#endif
  const uint64_t r = x > 0.0 ? uint64_t(x) : 0;  // truncation
  return r < total ? r : total - 1;
}

}  // namespace dsv4
