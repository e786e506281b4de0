// SPDX-License-Identifier: MIT
// Register-level weight decoding for the mma.sync kernels: packed checkpoint bytes -> bf16x2 words whose low half
// is the even element (natural order, so activations need no permutation). Every value equals the
// src/formats decoders exactly (tests/cuda checks all codes): the bit tricks only move the code's exponent and
// mantissa bits into bf16 positions (byte permutes, masks, and multiplies that act as shifts on the FMA pipe), which represents `value * 2^-bias_gap`, and one bf16x2 multiply by a
// power-of-two factor (with any block scale folded in when that stays exact) restores the value.
//   e4m3 -> bf16 bits (s<<15 | (e,m)<<4)  = e4m3 * 2^-120  (e4m3 subnormals land on bf16 subnormals: exact)
//   e2m1 -> bf16 bits (s<<15 | (e,m)<<6)  = e2m1 * 2^-126  (codes in the device layout of fp4_layout.h)
// IMPORTANT: the folded factors limit the scale range that decodes exactly (far outside real checkpoints):
//   FP8 block e8m0 exponent E <= 134, MXFP4 e8m0 exponent 2 <= E <= 128; NVFP4 and FP8 f32 scales are unrestricted.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/fp4_layout.h"
#include "formats/fp8.h"

namespace dsv4::dq {

// 16 weight bytes, streamed once: kept out of L1 so that the activations stay there.
__device__ __forceinline__ uint4 load_weights(const uint8_t* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

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

// PTX prmt in its default mode: a selector nibble with bit 3 set replicates the sign of the chosen byte, which gives
// a zero byte whenever that byte is < 0x80 (CUDA's __byte_perm documents only 3-bit selectors).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// Four e4m3 bytes (b0 lowest) -> out[0] = (b0, b1), out[1] = (b2, b3), each multiplied by `factor`
// (bf16x2 of 2^120 * block scale; the 2^120 undoes the bias gap).
// Per half we need (b & 0x7f) << 4 | (b & 0x80) << 8 = b * 16 + (b & 0x80) * 240: the carry of the second term
// moves the sign from bit 11 to bit 15. Two integer-ALU ops per pair; the multiplies run on the FMA pipe.
__device__ __forceinline__ void e4m3x4_to_bf16x2(uint32_t q, uint32_t factor, uint32_t out[2]) {
  const uint32_t t0 = prmt(q, 0, 0x4140);  // [b0, 0, b1, 0]
  const uint32_t t1 = prmt(q, 0, 0x4342);  // [b2, 0, b3, 0]
  const uint32_t r0 = t0 * 16u + (t0 & 0x00800080u) * 240u;
  const uint32_t r1 = t1 * 16u + (t1 & 0x00800080u) * 240u;
  out[0] = bf16x2_mul(r0, factor);
  out[1] = bf16x2_mul(r1, factor);
}

// Eight e2m1 codes of one word in the device layout (fp4_layout.h) -> out[p] = (element 2p, element 2p+1),
// p = 0..3, each multiplied by `factor` (bf16x2 of 2^126 * scale, see the callers).
__device__ __forceinline__ void e2m1x8_to_bf16x2(uint32_t q, uint32_t factor, uint32_t out[4]) {
  fp4_layout::raw_bf16x2(q, out);
#pragma unroll
  for (int p = 0; p < 4; ++p) out[p] = bf16x2_mul(out[p], factor);
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
// The two factors of a piece's scale bytes (s0 = bits 0-7, s1 = bits 8-15), as nvfp4_factor gives them but in
// ~8 instructions instead of ~30 (the decode of a 16-element block is ~20, so this matters in the fp4 GEMVs): the
// e4m3 bit move above gives s * 2^-120 in each half (subnormal scales land on bf16 subnormals, exactly), and two
// exact power-of-two multiplies take it to s * 2^118 (2^238 is not a bf16). NaN scale codes (0x7f, 0xff) are
// outside the contract, as for nvfp4_factor. f0 = (s0 * 2^118) in both halves, f1 likewise for s1.
__device__ __forceinline__ void nvfp4_factor_pair(uint32_t s, uint32_t& f0, uint32_t& f1) {
  const uint32_t t = prmt(s, 0, 0x4140);  // [s0, 0, s1, 0]
  const uint32_t r = t * 16u + (t & 0x00800080u) * 240u;
  const uint32_t two119 = bf16x2_pow2(119);
  const uint32_t both = bf16x2_mul(bf16x2_mul(r, two119), two119);
  f0 = prmt(both, 0, 0x1010);
  f1 = prmt(both, 0, 0x3232);
}

}  // namespace dsv4::dq
