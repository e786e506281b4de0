// SPDX-License-Identifier: MIT
// Element formats and the simulated block roundings (spec 8.1), checked exhaustively against their bit tables.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cpu/ops.h"
#include "formats/fp4.h"
#include "formats/fp8.h"

using namespace dsv4;

TEST(Formats, E4M3EveryCodeRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float v = e4m3_to_f32(uint8_t(code));
    if (std::isnan(v)) {
      EXPECT_TRUE((code & 0x7f) == 0x7f) << code;
      continue;
    }
    EXPECT_EQ(round_e4m3(v), v) << code;
    if (v != 0.0f) EXPECT_EQ(f32_to_e4m3(v), code) << code;
  }
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));
}

TEST(Formats, E4M3RoundsToNearestEvenAndSaturates) {
  // Neighbours 1.0 (mantissa 000) and 1.125 (001): the midpoint goes to the even mantissa.
  EXPECT_EQ(round_e4m3(1.0625f), 1.0f);
  EXPECT_EQ(round_e4m3(1.1875f), 1.25f);  // between 1.125 (odd) and 1.25 (even)
  EXPECT_EQ(round_e4m3(1.07f), 1.125f);
  EXPECT_EQ(round_e4m3(1000.0f), 448.0f);
  EXPECT_EQ(round_e4m3(-1000.0f), -448.0f);
  EXPECT_EQ(round_e4m3(std::ldexp(1.5f, -9)), std::ldexp(2.0f, -9));  // subnormal tie -> even
  // Brute force: the rounded value is a representable neighbour at minimal distance.
  std::vector<float> grid;
  for (int code = 0; code < 127; ++code) grid.push_back(e4m3_to_f32(uint8_t(code)));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(0.0f, 460.0f);
  for (int i = 0; i < 20000; ++i) {
    const float x = u(rng) * std::pow(2.0f, -float(i % 12));
    const float r = round_e4m3(x);
    float best = INFINITY;
    for (float g : grid) best = std::min(best, std::fabs(g - x));
    EXPECT_EQ(std::fabs(r - x), best) << x;
  }
}

TEST(Formats, E2M1TableAndTies) {
  const float magnitudes[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_to_f32(uint8_t(c));
    EXPECT_EQ(std::fabs(v), magnitudes[c & 7]);
    if (c & 7) EXPECT_EQ(f32_to_e2m1(v), c);
  }
  EXPECT_EQ(round_e2m1(0.25f), 0.0f);
  EXPECT_EQ(round_e2m1(0.75f), 1.0f);
  EXPECT_EQ(round_e2m1(1.25f), 1.0f);
  EXPECT_EQ(round_e2m1(1.75f), 2.0f);
  EXPECT_EQ(round_e2m1(2.5f), 2.0f);
  EXPECT_EQ(round_e2m1(3.5f), 4.0f);
  EXPECT_EQ(round_e2m1(5.0f), 4.0f);
  EXPECT_EQ(round_e2m1(-5.5f), -6.0f);
  EXPECT_EQ(round_e2m1(100.0f), 6.0f);
}

TEST(Formats, Bf16RoundNearestEven) {
  EXPECT_EQ(round_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);                              // tie -> even
  EXPECT_EQ(round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));  // tie -> even (up)
  EXPECT_TRUE(std::isnan(round_bf16(NAN)));
}

TEST(Formats, Fp8BlockSimulationUsesPowerOfTwoScale) {
  std::vector<float> x(64);
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (float& v : x) v = n(rng);
  float amax = 0;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  const float s = std::exp2(std::ceil(std::log2(amax / 448.0f)));
  std::vector<float> y = x;
  fp8_simulate_block(y.data(), 64);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(y[i], round_e4m3(x[i] / s) * s);
    EXPECT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) * 0.0625f + s * std::ldexp(1.0f, -9));
  }
}

TEST(Ops, HadamardIsOrthonormalSylvester) {
  const int n = 8;
  for (int col = 0; col < n; ++col) {
    std::vector<float> e(n, 0.0f);
    e[col] = 1.0f;
    cpu::hadamard_transform(e.data(), n);
    for (int row = 0; row < n; ++row) {
      const int sign = __builtin_popcount(row & col) % 2 ? -1 : 1;  // Sylvester: H[i][j] = (-1)^popcount(i&j)
      EXPECT_FLOAT_EQ(e[row], sign / std::sqrt(float(n)));
    }
  }
}

TEST(Ops, RoundIndexerFp4RotatesThenQuantises) {
  std::vector<float> x(128);
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : x) v = n(rng);
  std::vector<float> expect = x;
  cpu::hadamard_transform(expect.data(), 128);
  for (int b = 0; b < 128; b += 32) {
    float amax = 0;
    for (int i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(expect[i]));
    const float s = std::exp2(std::ceil(std::log2(amax / 6.0f)));
    for (int i = b; i < b + 32; ++i) expect[i] = round_e2m1(expect[i] / s) * s;
  }
  cpu::round_indexer(x.data(), 128, cpu::IndexerStorage::FP4);
  EXPECT_EQ(x, expect);
}

TEST(Ops, TopKOrdersByValueThenIndex) {
  const std::vector<float> v = {1, 3, 3, 0, 2, 3};
  EXPECT_EQ(cpu::top_k_indices(v, 4), (std::vector<int>{1, 2, 5, 4}));
  EXPECT_EQ(cpu::top_k_indices(v, 10).size(), 6u);
}

TEST(Ops, RopeInverseUndoesRotation) {
  std::vector<float> x = {0.3f, -1.2f, 2.0f, 0.7f}, orig = x;
  const float inv_freq[2] = {1.0f, 0.01f};
  cpu::rope_interleaved(x.data(), 4, inv_freq, 37, false);
  EXPECT_NEAR(x[0], 0.3f * std::cos(37.0f) + 1.2f * std::sin(37.0f), 1e-5);
  cpu::rope_interleaved(x.data(), 4, inv_freq, 37, true);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(x[i], orig[i], 1e-5);
}
