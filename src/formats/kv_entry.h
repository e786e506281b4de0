// SPDX-License-Identifier: MIT
// KV-cache entries in the bytes they are stored as (spec 6, "lossless compact layout"). The reference rounds its KV
// values before storing them: FP8 on the nope dims (e4m3, a power-of-two scale per 64) and bf16 on the rope dims,
// and its indexer keys FP4 after the Hadamard rotation (e2m1, a power-of-two scale per 32). Keeping the codes and
// the scales instead of the floats they stand for loses nothing, and an entry shrinks 3.5x (main) / 6.4x (indexer)
// against fp32.
//
//   KvCodec::Fp8     [nope e4m3 codes][rope bf16][nope/64 e8m0 scales][zeros to a multiple of 16 bytes]
//                    head_dim 512, rope 64: 448 + 128 + 7 -> 592 B (fp32: 2048)
//   KvCodec::Fp4     [dim/2 bytes of e2m1 pairs, low nibble first][dim/32 e8m0 scales][zeros to 16 bytes]
//                    index_head_dim 128: 64 + 4 -> 80 B (fp32: 512)
//   KvCodec::Bf16    dim bf16 values;   KvCodec::F32: dim floats.
// Sections start at multiples of 16 bytes when nope % 64 == 0 (Fp8) and dim % 32 == 0 (Fp4), so a kernel can read
// them with vector loads. Encoding a vector that is not already rounded stores its rounding: decode(encode(x)) is
// exactly what cpu::round_kv / the FP4 step of cpu::round_indexer make of x (same scale rule, fp8_simulate_block
// and fp4_simulate_block), and decode(encode(decode(e))) == decode(e) bit for bit.
#pragma once
#include <cstdint>
#include <cstring>

#include "formats/blocks.h"

namespace dsv4 {

enum class KvCodec : uint8_t { F32, Bf16, Fp8, Fp4 };

constexpr int kKvFp8Block = 64;  // nope values sharing one e8m0 scale
constexpr int kKvFp4Block = 32;  // indexer values sharing one e8m0 scale

DSV4_HD constexpr int kv_round_up16(int bytes) { return (bytes + 15) / 16 * 16; }

// Bytes of one entry of `dim` values, `rope` of them (the last ones) rope dims; rope is read by Fp8 only.
DSV4_HD constexpr int kv_entry_bytes(KvCodec codec, int dim, int rope) {
  switch (codec) {
    case KvCodec::F32: return 4 * dim;
    case KvCodec::Bf16: return 2 * dim;
    case KvCodec::Fp8: return kv_round_up16((dim - rope) + 2 * rope + (dim - rope) / kKvFp8Block);
    case KvCodec::Fp4: return kv_round_up16(dim / 2 + dim / kKvFp4Block);
  }
  return 0;
}

// The e8m0 byte of a power-of-two scale >= 2^-126 (fp8_block_scale and fp4_block_scale floor theirs far above that).
DSV4_HD uint8_t kv_scale_byte(float pow2) { return uint8_t((f32_to_bits(pow2) >> 23) & 0xff); }

// Fp8: the nope dims need dim - rope to be a multiple of 64; Fp4: dim a multiple of 32 (callers check).
DSV4_HD void encode_kv_entry(KvCodec codec, const float* x, int dim, int rope, uint8_t* entry) {
  const int bytes = kv_entry_bytes(codec, dim, rope);
  if (codec == KvCodec::F32) {
    std::memcpy(entry, x, size_t(bytes));
    return;
  }
  if (codec == KvCodec::Bf16) {
    for (int i = 0; i < dim; ++i) {
      const uint16_t b = f32_to_bf16(x[i]);
      std::memcpy(entry + 2 * i, &b, 2);
    }
    return;
  }
  if (codec == KvCodec::Fp8) {
    const int nope = dim - rope;
    uint8_t* scales = entry + nope + 2 * rope;
    for (int b = 0; b < nope / kKvFp8Block; ++b) {
      const float* xb = x + b * kKvFp8Block;
      const float s = fp8_block_scale(xb, kKvFp8Block);  // fp8_simulate_block's scale
      scales[b] = kv_scale_byte(s);
      for (int i = 0; i < kKvFp8Block; ++i) entry[b * kKvFp8Block + i] = f32_to_e4m3(xb[i] / s);
    }
    for (int i = 0; i < rope; ++i) {
      const uint16_t v = f32_to_bf16(x[nope + i]);
      std::memcpy(entry + nope + 2 * i, &v, 2);
    }
    for (int i = nope + 2 * rope + nope / kKvFp8Block; i < bytes; ++i) entry[i] = 0;
    return;
  }
  uint8_t* scales = entry + dim / 2;
  for (int b = 0; b < dim / kKvFp4Block; ++b) {
    const float* xb = x + b * kKvFp4Block;
    const float s = fp4_block_scale(xb, kKvFp4Block);  // fp4_simulate_block's scale
    scales[b] = kv_scale_byte(s);
    for (int i = 0; i < kKvFp4Block; i += 2)
      entry[(b * kKvFp4Block + i) / 2] = pack_fp4_pair(f32_to_e2m1(xb[i] / s), f32_to_e2m1(xb[i + 1] / s));
  }
  for (int i = dim / 2 + dim / kKvFp4Block; i < bytes; ++i) entry[i] = 0;
}

// Value i of an entry (the element map of the layouts above).
DSV4_HD float kv_entry_value(KvCodec codec, const uint8_t* entry, int dim, int rope, int i) {
  switch (codec) {
    case KvCodec::F32: {
      float v;
      std::memcpy(&v, entry + 4 * i, 4);
      return v;
    }
    case KvCodec::Bf16: {
      uint16_t b;
      std::memcpy(&b, entry + 2 * i, 2);
      return bf16_to_f32(b);
    }
    case KvCodec::Fp8: {
      const int nope = dim - rope;
      if (i >= nope) {
        uint16_t b;
        std::memcpy(&b, entry + nope + 2 * (i - nope), 2);
        return bf16_to_f32(b);
      }
      return e4m3_to_f32(entry[i]) * e8m0_to_f32(entry[nope + 2 * rope + i / kKvFp8Block]);
    }
    case KvCodec::Fp4:
      return e2m1_to_f32(fp4_code_at(entry, i)) * e8m0_to_f32(entry[dim / 2 + i / kKvFp4Block]);
  }
  return 0.0f;
}

DSV4_HD void decode_kv_entry(KvCodec codec, const uint8_t* entry, int dim, int rope, float* x) {
  for (int i = 0; i < dim; ++i) x[i] = kv_entry_value(codec, entry, dim, rope, i);
}

}  // namespace dsv4
