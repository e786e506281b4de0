// SPDX-License-Identifier: MIT
// Register-level weight decoding for the mma.sync kernels: packed checkpoint bytes -> bf16x2 words whose low half
// is the even element (natural order, so activations need no permutation). Every value equals the
// src/formats decoders exactly (tests/cuda checks all codes): the bit tricks only move the code's exponent and
// mantissa bits into bf16 positions, which represents `value * 2^-bias_gap`, and one bf16x2 multiply by a
// power-of-two factor (with any block scale folded in when that stays exact) restores the value.
//   e4m3 -> bf16 bits (s<<15 | (e,m)<<4)  = e4m3 * 2^-120  (e4m3 subnormals land on bf16 subnormals: exact)
//   e2m1 -> bf16 bits (s<<15 | (e,m)<<6)  = e2m1 * 2^-126
// IMPORTANT: the folded factors limit the scale range that decodes exactly (far outside real checkpoints):
//   FP8 block e8m0 exponent E <= 134, MXFP4 e8m0 exponent 2 <= E <= 128; NVFP4 and FP8 f32 scales are unrestricted.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "formats/fp8.h"

namespace dsv4::dq {

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// bf16 bits of 2^e, broadcast to both halves (e in [-126, 127]).
__device__ __forceinline__ uint32_t bf16x2_pow2(int e) {
  const uint32_t h = uint32_t(e + 127) << 7;
  return h | (h << 16);
}

__device__ __forceinline__ uint32_t bf16x2_broadcast(float f) {
  const uint32_t h = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  return h | (h << 16);
}

// Four e4m3 bytes (b0 lowest) -> out[0] = (b0, b1), out[1] = (b2, b3), each multiplied by `factor`
// (bf16x2 of 2^120 * block scale; the 2^120 undoes the bias gap).
__device__ __forceinline__ void e4m3x4_to_bf16x2(uint32_t q, uint32_t factor, uint32_t out[2]) {
  const uint32_t t0 = __byte_perm(q, 0, 0x1404);  // [0, b0, 0, b1]
  const uint32_t t1 = __byte_perm(q, 0, 0x3424);  // [0, b2, 0, b3]
  const uint32_t r0 = (t0 & 0x80008000u) | ((t0 >> 4) & 0x07F007F0u);
  const uint32_t r1 = (t1 & 0x80008000u) | ((t1 >> 4) & 0x07F007F0u);
  out[0] = bf16x2_mul(r0, factor);
  out[1] = bf16x2_mul(r1, factor);
}

// Eight e2m1 nibbles (nibble j = element j, low nibble first) -> out[p] = (element 2p, element 2p+1), p = 0..3,
// each multiplied by `factor` (bf16x2 of 2^126 * scale, see the callers).
__device__ __forceinline__ void e2m1x8_to_bf16x2(uint32_t q, uint32_t factor, uint32_t out[4]) {
  const uint32_t q4 = q >> 4;
  // t_lo = [q.b0, q.b1, q4.b0, q4.b1]: nibble 0 at bits 0..3, 1 at 16..19, 2 at 8..11, 3 at 24..27.
  const uint32_t t_lo = __byte_perm(q, q4, 0x5410);
  const uint32_t t_hi = __byte_perm(q, q4, 0x7632);  // same for nibbles 4..7
  const uint32_t r0 = ((t_lo << 6) & 0x01C001C0u) | ((t_lo << 12) & 0x80008000u);
  const uint32_t r1 = ((t_lo >> 2) & 0x01C001C0u) | ((t_lo << 4) & 0x80008000u);
  const uint32_t r2 = ((t_hi << 6) & 0x01C001C0u) | ((t_hi << 12) & 0x80008000u);
  const uint32_t r3 = ((t_hi >> 2) & 0x01C001C0u) | ((t_hi << 4) & 0x80008000u);
  out[0] = bf16x2_mul(r0, factor);
  out[1] = bf16x2_mul(r1, factor);
  out[2] = bf16x2_mul(r2, factor);
  out[3] = bf16x2_mul(r3, factor);
}

// Factors. Each returns the bf16x2 multiplier for the raw bit patterns above.
// FP8 block, e8m0 scale byte E: 2^120 * 2^(E-127) = 2^(E-7).
__device__ __forceinline__ uint32_t fp8_factor_e8m0(uint32_t e) { return bf16x2_pow2(int(e) - 7); }
// FP8 block, fp32 scale: the scale is applied to fp32 partial sums instead (not exact in bf16).
__device__ __forceinline__ uint32_t fp8_factor_unit() { return bf16x2_pow2(120); }
// MXFP4, e8m0 scale byte E: 2^126 * 2^(E-127) = 2^(E-1).
__device__ __forceinline__ uint32_t mxfp4_factor(uint32_t e) { return bf16x2_pow2(int(e) - 1); }
// NVFP4, e4m3 block scale s: 2^126 * s * 2^-8 (e4m3 * 2^118 stays below bf16's max); the kernel multiplies the
// output by weight_scale_2 * 2^8. The products e2m1 * s * 2^-8 are >= 2^-18: exact normal bf16 values.
constexpr float kNvfp4OutputFactor = 256.0f;
__device__ __forceinline__ uint32_t nvfp4_factor(uint32_t s) {
  return bf16x2_broadcast(e4m3_to_f32(uint8_t(s)) * 0x1p118f);
}

}  // namespace dsv4::dq
