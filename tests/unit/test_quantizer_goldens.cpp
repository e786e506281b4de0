// SPDX-License-Identifier: MIT
// The simulated roundings against the independent PyTorch reference (reference/dsv4_ref.py, outputs in
// tests/data/golden/quantizers): bit for bit for fp8/fp4/bf16, ~1e-6 relative for the Hadamard rotation.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "cpu/ops.h"
#include "formats/bf16.h"
#include "formats/fp4.h"
#include "formats/fp8.h"
#include "io/npy.h"

using namespace dsv4;

namespace {
NpyArray load(const std::string& name) {
  return read_npy((std::filesystem::path(DSV4_TEST_DATA) / "golden" / "quantizers" / (name + ".npy")).string());
}
std::vector<float> as_float(const NpyArray& a) { return std::vector<float>(a.values.begin(), a.values.end()); }
}  // namespace

TEST(QuantizerGoldens, Fp8Sim64BitExact) {
  std::vector<float> x = as_float(load("fp8sim64_in"));
  const NpyArray ref = load("fp8sim64_out");
  ASSERT_EQ(x.size(), ref.values.size());
  for (size_t b = 0; b < x.size(); b += 64) fp8_simulate_block(&x[b], 64);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], float(ref.values[i])) << "element " << i;
}

TEST(QuantizerGoldens, Fp4Sim32BitExact) {
  std::vector<float> x = as_float(load("fp4sim32_in"));
  const NpyArray ref = load("fp4sim32_out");
  ASSERT_EQ(x.size(), ref.values.size());
  for (size_t b = 0; b < x.size(); b += 32) fp4_simulate_block(&x[b], 32);
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], float(ref.values[i])) << "element " << i;
}

TEST(QuantizerGoldens, Bf16BitExact) {
  const std::vector<float> x = as_float(load("bf16_in"));
  const NpyArray ref = load("bf16_out");
  ASSERT_EQ(x.size(), ref.values.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(round_bf16(x[i]), float(ref.values[i])) << "element " << i;
}

TEST(QuantizerGoldens, HadamardAndIndexerFp4) {
  const std::vector<float> x = as_float(load("hadamard128_in"));
  const NpyArray rotated = load("hadamard128_out"), quantised = load("hadamard_fp4sim_out");
  int differing_rounding = 0;
  for (size_t row = 0; row * 128 < x.size(); ++row) {
    std::vector<float> h(x.begin() + row * 128, x.begin() + (row + 1) * 128), q = h;
    cpu::hadamard_transform(h.data(), 128);
    cpu::round_indexer(q.data(), 128, cpu::IndexerStorage::FP4);
    for (int i = 0; i < 128; ++i) {
      const double r = rotated.values[row * 128 + i];
      ASSERT_NEAR(h[i], r, 1e-6 * (1 + std::fabs(r))) << "row " << row << " dim " << i;
      // A different summation order could in principle flip a rounding at a midpoint; on this data none may.
      differing_rounding += q[i] != float(quantised.values[row * 128 + i]);
    }
  }
  EXPECT_EQ(differing_rounding, 0);
}
