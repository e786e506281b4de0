// SPDX-License-Identifier: MIT
// formats/kv_entry.h: the stored KV entries decode to exactly the values the reference's rounding makes (bit for
// bit, so the compact state cannot change a logit), in the byte layout the header states.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/ops.h"
#include "formats/kv_entry.h"

using namespace dsv4;

namespace {

// Blocks of very different magnitudes (the scales go from the 1e-4 floor to 2^20), exact zeros, negative zeros,
// powers of two and values on e4m3 / e2m1 rounding midpoints.
std::vector<float> awkward_vector(int dim, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(dim);
  for (int i = 0; i < dim; ++i) {
    const float magnitude = std::ldexp(1.0f, int(rng() % 40) - 26);
    switch (rng() % 8) {
      case 0: x[i] = 0.0f; break;
      case 1: x[i] = -0.0f; break;
      case 2: x[i] = std::ldexp(1.0f, int(rng() % 30) - 15); break;
      case 3: x[i] = 1.0625f * magnitude; break;  // between e4m3's 1.0 and 1.125
      default: x[i] = normal(rng) * magnitude;
    }
  }
  return x;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> round_trip(KvCodec codec, const std::vector<float>& x, int rope) {
  std::vector<uint8_t> entry(kv_entry_bytes(codec, int(x.size()), rope), 0xab);
  encode_kv_entry(codec, x.data(), int(x.size()), rope, entry.data());
  std::vector<float> y(x.size());
  decode_kv_entry(codec, entry.data(), int(x.size()), rope, y.data());
  return y;
}

}  // namespace

TEST(KvEntry, SizesAndSectionsOfTheFlashShapes) {
  EXPECT_EQ(kv_entry_bytes(KvCodec::Fp8, 512, 64), 592);  // 448 codes + 128 rope + 7 scales, to 16
  EXPECT_EQ(kv_entry_bytes(KvCodec::Fp4, 128, 0), 80);    // 64 code bytes + 4 scales, to 16
  EXPECT_EQ(kv_entry_bytes(KvCodec::Bf16, 512, 64), 1024);
  EXPECT_EQ(kv_entry_bytes(KvCodec::F32, 128, 0), 512);
  // The bytes of one entry, read by the layout's definition: code i, rope bf16 j, scale b, padding zero.
  std::vector<float> x = awkward_vector(512, 3);
  cpu::round_kv(x.data(), 512, 64, cpu::KvStorage::FP8);
  std::vector<uint8_t> e(592, 0xab);
  encode_kv_entry(KvCodec::Fp8, x.data(), 512, 64, e.data());
  for (int i = 0; i < 448; ++i)
    EXPECT_EQ(e4m3_to_f32(e[i]) * e8m0_to_f32(e[576 + i / 64]), x[i]) << "nope " << i;
  for (int j = 0; j < 64; ++j) EXPECT_EQ(bf16_to_f32(uint16_t(e[448 + 2 * j] | e[449 + 2 * j] << 8)), x[448 + j]);
  for (int i = 583; i < 592; ++i) EXPECT_EQ(e[i], 0) << "padding byte " << i;
}

TEST(KvEntry, Fp8DecodesToTheReferenceRoundingBitForBit) {
  for (const auto [dim, rope] : {std::pair{512, 64}, {128, 64}, {64, 0}, {192, 64}}) {
    for (uint32_t seed = 0; seed < 200; ++seed) {
      const std::vector<float> x = awkward_vector(dim, seed);
      std::vector<float> rounded = x;
      cpu::round_kv(rounded.data(), dim, rope, cpu::KvStorage::FP8);
      const std::vector<float> stored = round_trip(KvCodec::Fp8, x, rope);
      ASSERT_TRUE(same_bits(stored, rounded)) << "raw values, dim " << dim << " seed " << seed;
      // What the model stores is already rounded: the round trip must keep it (the scale may be found smaller).
      ASSERT_TRUE(same_bits(round_trip(KvCodec::Fp8, rounded, rope), rounded)) << "dim " << dim << " seed " << seed;
    }
  }
}

TEST(KvEntry, Fp4DecodesToTheReferenceRoundingBitForBit) {
  for (const int dim : {128, 64, 32}) {
    for (uint32_t seed = 0; seed < 300; ++seed) {
      std::vector<float> rotated = awkward_vector(dim, seed + 1000);
      cpu::hadamard_transform(rotated.data(), dim);
      std::vector<float> rounded = rotated;
      for (int b = 0; b < dim; b += kKvFp4Block) fp4_simulate_block(rounded.data() + b, kKvFp4Block);
      ASSERT_TRUE(same_bits(round_trip(KvCodec::Fp4, rotated, 0), rounded)) << "dim " << dim << " seed " << seed;
      ASSERT_TRUE(same_bits(round_trip(KvCodec::Fp4, rounded, 0), rounded)) << "dim " << dim << " seed " << seed;
    }
  }
  // Packed low nibble first: element 0 of {6, -0.5, ...} is the low nibble of byte 0.
  std::vector<float> x(32, 0.0f);
  x[0] = 6.0f;
  x[1] = -0.5f;
  std::vector<uint8_t> e(kv_entry_bytes(KvCodec::Fp4, 32, 0));
  encode_kv_entry(KvCodec::Fp4, x.data(), 32, 0, e.data());
  EXPECT_EQ(e[0], 0x97);   // high nibble 1001 = -0.5, low nibble 0111 = 6
  EXPECT_EQ(e[16], 127);   // amax 6 -> scale 2^0
}

TEST(KvEntry, Bf16AndF32KeepTheirValues) {
  std::vector<float> x = awkward_vector(96, 5);
  EXPECT_TRUE(same_bits(round_trip(KvCodec::F32, x, 0), x));
  std::vector<float> rounded = x;
  cpu::round_kv(rounded.data(), 96, 0, cpu::KvStorage::BF16);
  EXPECT_TRUE(same_bits(round_trip(KvCodec::Bf16, x, 0), rounded));
}
