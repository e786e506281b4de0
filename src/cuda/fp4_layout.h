// SPDX-License-Identifier: MIT
// How e2m1 codes sit in GPU memory. A checkpoint stores element j of each 32-bit word in nibble j (bits 4j..4j+3:
// m, e0, e1, sign from the low bit up). On the GPU every 32-bit word of MXFP4 / NVFP4 weights holds the same 8
// codes with their bits moved (`to_device` at upload), so that the kernels' decode into bf16 bit positions is
// 9 integer ops per word instead of 15 (the fp4 GEMVs are issue-bound on this decode, docs/perf.md). Words stay in
// place: only bits inside a word move, so rows, scales, strides and 16-byte pieces are unchanged.
//
// The decode (`raw_bf16x2`) gives out[p] = (element 2p, element 2p+1) as bf16x2 bit patterns with m, e0, e1 at
// bits 6, 7, 8 and the sign at 15 of each half (the value e2m1 * 2^-126, see dequant.cuh):
//   out[0] = w                 & 0x81C081C0
//   out[1] = (w << 6)          & 0x81C081C0
//   out[2] = rotr(w, 4)        & 0x81C081C0
//   out[3] = rotl(w, 2) & 0x80C080C0 | rotr(w, 6) & 0x01000100
// so kSource below is each target bit run backwards through its output's shift. The 32 positions are all
// different (tests/unit/test_fp4_layout.cpp checks this, the round trip and the decode against the nibble order).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSV4_FP4_HD __host__ __device__ __forceinline__
#else
#define DSV4_FP4_HD inline
#endif

namespace dsv4::fp4_layout {

// kSource[j][b]: device-word bit that holds bit b (0 m, 1 e0, 2 e1, 3 sign) of element j.
constexpr int kSource[8][4] = {
    {6, 7, 8, 15},    {22, 23, 24, 31},  // out[0]: in place
    {0, 1, 2, 9},     {16, 17, 18, 25},  // out[1]: shifted left by 6
    {10, 11, 12, 19}, {26, 27, 28, 3},   // out[2]: rotated right by 4
    {4, 5, 14, 13},   {20, 21, 30, 29},  // out[3]: m, e0, sign rotated left by 2; e1 rotated right by 6
};

constexpr uint32_t to_device(uint32_t natural) {
  uint32_t w = 0;
  for (int j = 0; j < 8; ++j)
    for (int b = 0; b < 4; ++b) w |= ((natural >> (4 * j + b)) & 1u) << kSource[j][b];
  return w;
}

constexpr uint32_t to_natural(uint32_t device) {
  uint32_t w = 0;
  for (int j = 0; j < 8; ++j)
    for (int b = 0; b < 4; ++b) w |= ((device >> kSource[j][b]) & 1u) << (4 * j + b);
  return w;
}

// Checkpoint bytes (a whole number of 32-bit words, little-endian) -> the device layout, in place.
inline void bytes_to_device(uint8_t* bytes, size_t n) {
  for (size_t i = 0; i + 4 <= n; i += 4) {
    uint32_t w;
    std::memcpy(&w, bytes + i, 4);
    w = to_device(w);
    std::memcpy(bytes + i, &w, 4);
  }
}

DSV4_FP4_HD uint32_t rotl(uint32_t x, int r) {
#if defined(__CUDA_ARCH__)
  return __funnelshift_l(x, x, r);
#else
  return (x << r) | (x >> ((32 - r) & 31));
#endif
}

// One device word -> the four bf16x2 bit patterns (before the factor multiply of dequant.cuh).
DSV4_FP4_HD void raw_bf16x2(uint32_t w, uint32_t out[4]) {
  constexpr uint32_t kMask = 0x81C081C0u;
  out[0] = w & kMask;
  out[1] = (w << 6) & kMask;
  out[2] = rotl(w, 28) & kMask;
  out[3] = (rotl(w, 2) & 0x80C080C0u) | (rotl(w, 26) & 0x01000100u);
}

// The same patterns computed from a checkpoint word (nibble j = element j): the definition raw_bf16x2 must match.
constexpr uint32_t natural_raw_bf16x2(uint32_t natural, int p) {
  const uint32_t lo = (natural >> (8 * p)) & 15u, hi = (natural >> (8 * p + 4)) & 15u;
  return ((lo | hi << 16) * 0x1040u) & 0x81C081C0u;  // n << 6 | n << 12 per half, masked to m e0 e1 and the sign
}

}  // namespace dsv4::fp4_layout
