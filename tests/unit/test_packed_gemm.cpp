// SPDX-License-Identifier: MIT
// The CPU backend's linears on packed weights (cpu::gemm_nt_packed over decode_packed_rows): random codes of every
// packed format, decoded here element by element from the format's definition (docs/formats.md) and multiplied in
// fp64; gemm_nt_packed must agree to fp32 rounding for decode-sized and prefill-sized x, row ranges that start
// inside the matrix, strided x and y, and accumulation. Bit equality of decode_packed_rows with dequantize on real
// checkpoints is tested in test_quant_e2e.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "formats/bf16.h"
#include "formats/blocks.h"
#include "formats/fp4.h"
#include "formats/fp8.h"
#include "formats/nvfp4.h"
#include "quant/stored_weight.h"

namespace dsv4 {
namespace {

// A packed weight over bytes this struct owns, and its values decoded from the format's definition.
struct Packed {
  std::vector<uint8_t> w, scale;
  PackedWeight view;
  std::vector<double> values;  // [N, K]
};

uint8_t e4m3_code(std::mt19937& rng) {  // any finite code
  for (;;) {
    const uint8_t c = uint8_t(rng() & 0xff);
    if ((c & 0x7f) != 0x7f) return c;
  }
}

// NVFP4 takes scale_2 as its global scale, and some of its block scales are +0 and -0.
Packed make_packed(WeightFormat format, bool scale_f32, int N, int K, std::mt19937& rng, float scale_2 = 0.37f) {
  Packed p;
  p.view.format = format;
  p.values.resize(size_t(N) * K);
  switch (format) {
    case WeightFormat::Float: {  // bf16
      p.w.resize(size_t(N) * K * 2);
      for (int64_t i = 0; i < int64_t(N) * K; ++i) {
        const uint16_t b = f32_to_bf16(std::normal_distribution<float>(0.0f, 0.1f)(rng));
        std::memcpy(&p.w[size_t(i) * 2], &b, 2);
        p.values[size_t(i)] = bf16_to_f32(b);
      }
      break;
    }
    case WeightFormat::Fp8Block: {
      const int rb = int(ceil_div(N, kFp8BlockSize)), cb = int(ceil_div(K, kFp8BlockSize));
      p.w.resize(size_t(N) * K);
      for (uint8_t& c : p.w) c = e4m3_code(rng);
      std::vector<float> scales(size_t(rb) * cb);
      p.scale.resize(scales.size() * (scale_f32 ? 4 : 1));
      for (size_t b = 0; b < scales.size(); ++b) {
        if (scale_f32) {
          scales[b] = std::uniform_real_distribution<float>(0.001f, 0.01f)(rng);
          std::memcpy(&p.scale[b * 4], &scales[b], 4);
        } else {
          p.scale[b] = uint8_t(115 + rng() % 10);  // 2^-12 .. 2^-3
          scales[b] = std::ldexp(1.0f, int(p.scale[b]) - 127);
        }
      }
      for (int r = 0; r < N; ++r)
        for (int i = 0; i < K; ++i)
          p.values[size_t(r) * K + i] =  // an fp32 product, as the decode's contract says
              double(e4m3_to_f32(p.w[size_t(r) * K + i]) * scales[size_t(r / kFp8BlockSize) * cb + i / kFp8BlockSize]);
      p.view.scale_f32 = scale_f32;
      break;
    }
    case WeightFormat::Mxfp4:
    case WeightFormat::Nvfp4: {
      const bool nv = format == WeightFormat::Nvfp4;
      const int group = nv ? kNvfp4GroupSize : kMxfp4GroupSize;
      p.w.resize(size_t(N) * K / 2);
      for (uint8_t& b : p.w) b = uint8_t(rng() & 0xff);
      p.scale.resize(size_t(N) * K / group);
      for (size_t i = 0; i < p.scale.size(); ++i)
        p.scale[i] = !nv ? uint8_t(118 + rng() % 8) : i % 7 == 3 ? 0x00 : i % 11 == 5 ? 0x80 : uint8_t(0x20 + rng() % 0x30);
      p.view.scale_2 = nv ? scale_2 : 1.0f;
      for (int r = 0; r < N; ++r)
        for (int i = 0; i < K; ++i) {
          const uint8_t byte = p.w[size_t(r) * K / 2 + i / 2];
          const uint8_t code = i % 2 == 0 ? byte & 0xf : byte >> 4;  // element 2j in the low nibble
          const uint8_t s = p.scale[size_t(r) * (K / group) + i / group];
          p.values[size_t(r) * K + i] =
              nv ? double(nvfp4_decode(code, e4m3_to_f32(s), p.view.scale_2))
                 : double(e2m1_to_f32(code)) * std::ldexp(1.0, int(s) - 127);
        }
      break;
    }
    case WeightFormat::Fp8Tensor: break;
  }
  p.view.w = p.w.data();
  p.view.w_bytes = p.w.size();
  p.view.scale = p.scale.empty() ? nullptr : p.scale.data();
  p.view.scale_bytes = p.scale.size();
  return p;
}

struct Case {
  WeightFormat format;
  bool scale_f32;
  const char* name;
};

// Bit for bit, signed zeros included (the fp4 rows also go through the AVX2 shuffle where the CPU has it; a tiny global
// scale sends them down the table loop).
TEST(PackedGemm, DecodedRowsFollowTheFormats) {
  std::mt19937 rng(5);
  for (const Case& c : {Case{WeightFormat::Float, false, "bf16"}, Case{WeightFormat::Fp8Block, false, "fp8 e8m0"},
                        Case{WeightFormat::Fp8Block, true, "fp8 f32"}, Case{WeightFormat::Mxfp4, false, "mxfp4"},
                        Case{WeightFormat::Nvfp4, false, "nvfp4"}, Case{WeightFormat::Nvfp4, true, "nvfp4 tiny"}}) {
    const int N = 300, K = 256;
    const bool tiny = c.format == WeightFormat::Nvfp4 && c.scale_f32;
    const Packed p = make_packed(c.format, c.scale_f32 && !tiny, N, K, rng, tiny ? 1e-38f : 0.37f);
    std::vector<float> rows(size_t(7) * K);
    int negative_zeros = 0;
    for (int first : {0, 1, 127, 128, 293}) {
      decode_packed_rows(p.view, K, first, 7, rows.data());
      for (int r = 0; r < 7; ++r)
        for (int i = 0; i < K; ++i) {
          const float got = rows[size_t(r) * K + i], want = float(p.values[size_t(first + r) * K + i]);
          uint32_t got_bits, want_bits;
          std::memcpy(&got_bits, &got, 4);
          std::memcpy(&want_bits, &want, 4);
          ASSERT_EQ(got_bits, want_bits) << c.name << " row " << first + r << " col " << i << ": " << got << " vs "
                                         << want;
          negative_zeros += got == 0.0f && std::signbit(got);
        }
    }
    if (c.format == WeightFormat::Nvfp4 || c.format == WeightFormat::Mxfp4) EXPECT_GT(negative_zeros, 0) << c.name;
  }
}

TEST(PackedGemm, MatchesFp64Products) {
  std::mt19937 rng(9);
  for (const Case& c : {Case{WeightFormat::Float, false, "bf16"}, Case{WeightFormat::Fp8Block, false, "fp8 e8m0"},
                        Case{WeightFormat::Fp8Block, true, "fp8 f32"}, Case{WeightFormat::Mxfp4, false, "mxfp4"},
                        Case{WeightFormat::Nvfp4, false, "nvfp4"}})
    for (const auto& [N, K] : {std::pair{77, 64}, std::pair{600, 256}}) {  // below and above the parallel threshold
      const Packed p = make_packed(c.format, c.scale_f32, N, K, rng);
      for (int M : {1, 5, 8, 9, 40})
        for (const auto& [row0, rows] : {std::pair{0, N}, std::pair{N / 3, N - N / 3 - 1}})
          for (bool accumulate : {false, true}) {
            const int ldx = K + 3, ldy = rows + 5;
            std::vector<float> x(size_t(M) * ldx), y(size_t(M) * ldy);
            for (float& v : x) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
            for (float& v : y) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
            const std::vector<float> before = y;
            cpu::gemm_nt_packed(x.data(), ldx, p.view, row0, y.data(), ldy, M, rows, K, accumulate);
            const std::string what = std::string(c.name) + " N " + std::to_string(N) + " M " + std::to_string(M) +
                                     " row0 " + std::to_string(row0) + (accumulate ? " accumulate" : "");
            for (int m = 0; m < M; ++m) {
              for (int r = 0; r < rows; ++r) {
                double want = accumulate ? double(before[size_t(m) * ldy + r]) : 0.0, scale = std::fabs(want);
                for (int i = 0; i < K; ++i) {
                  const double t = double(x[size_t(m) * ldx + i]) * p.values[size_t(row0 + r) * K + i];
                  want += t;
                  scale += std::fabs(t);
                }
                ASSERT_NEAR(y[size_t(m) * ldy + r], want, 1.2e-7 * (K + 2) * scale)  // fp32 summation bound
                    << what << " at (" << m << ", " << r << ")";
              }
              for (int r = rows; r < ldy; ++r)  // the stride's gap is left alone
                ASSERT_EQ(y[size_t(m) * ldy + r], before[size_t(m) * ldy + r]) << what;
            }
          }
    }
}

}  // namespace
}  // namespace dsv4
