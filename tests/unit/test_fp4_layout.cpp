// SPDX-License-Identifier: MIT
// The device layout of e2m1 words (src/cuda/fp4_layout.h) on the CPU: the GPU kernels decode with the same
// raw_bf16x2, so a wrong bit table shows here first, without a GPU.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <vector>

#include "cuda/fp4_layout.h"
#include "formats/fp4.h"

namespace dsv4 {
namespace {

uint32_t nibble_word(int j, uint32_t code) { return code << (4 * j); }

TEST(Fp4Layout, EveryBitHasItsOwnPosition) {
  std::set<int> seen;
  for (const auto& element : fp4_layout::kSource)
    for (int bit : element) {
      EXPECT_GE(bit, 0);
      EXPECT_LT(bit, 32);
      seen.insert(bit);
    }
  EXPECT_EQ(seen.size(), 32u);
}

TEST(Fp4Layout, DecodeMatchesTheNibbleOrderForEveryCodeAtEveryPosition) {
  // One code at one element, the others zero, then the same code everywhere: each output pattern against the
  // checkpoint-order definition, and its value against the e2m1 decoder.
  for (int j = 0; j < 8; ++j)
    for (uint32_t code = 0; code < 16; ++code) {
      for (const uint32_t natural : {nibble_word(j, code), code * 0x11111111u}) {
        uint32_t out[4];
        fp4_layout::raw_bf16x2(fp4_layout::to_device(natural), out);
        for (int p = 0; p < 4; ++p)
          EXPECT_EQ(out[p], fp4_layout::natural_raw_bf16x2(natural, p))
              << "element " << j << " code " << code << " output " << p;
        // The half holding element j is e2m1(code) * 2^-126 as a bf16 bit pattern (subnormal for the small codes).
        const uint32_t half = (out[j / 2] >> (16 * (j % 2))) & 0xffffu;
        const float value = std::ldexp(float(std::bit_cast<float>(half << 16)), 126);
        EXPECT_EQ(value, e2m1_to_f32(uint8_t(code))) << "element " << j << " code " << code;
      }
    }
}

TEST(Fp4Layout, RandomWordsDecodeAndRoundTrip) {
  std::mt19937 rng(20261205);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t natural = rng();
    const uint32_t device = fp4_layout::to_device(natural);
    ASSERT_EQ(fp4_layout::to_natural(device), natural);
    uint32_t out[4];
    fp4_layout::raw_bf16x2(device, out);
    for (int p = 0; p < 4; ++p) ASSERT_EQ(out[p], fp4_layout::natural_raw_bf16x2(natural, p)) << std::hex << natural;
  }
}

TEST(Fp4Layout, BytesConvertWordByWord) {
  std::vector<uint8_t> bytes(64);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = uint8_t(37 * i + 11);
  std::vector<uint8_t> converted = bytes;
  fp4_layout::bytes_to_device(converted.data(), converted.size());
  for (size_t w = 0; w < bytes.size() / 4; ++w) {
    const uint32_t natural = uint32_t(bytes[4 * w]) | uint32_t(bytes[4 * w + 1]) << 8 |
                             uint32_t(bytes[4 * w + 2]) << 16 | uint32_t(bytes[4 * w + 3]) << 24;
    const uint32_t device = uint32_t(converted[4 * w]) | uint32_t(converted[4 * w + 1]) << 8 |
                            uint32_t(converted[4 * w + 2]) << 16 | uint32_t(converted[4 * w + 3]) << 24;
    EXPECT_EQ(device, fp4_layout::to_device(natural)) << "word " << w;
  }
}

}  // namespace
}  // namespace dsv4
