// SPDX-License-Identifier: MIT
// Skinny-GEMM tests: every format x m (all four kernel n-tile variants) x output type on shapes whose n is not a
// multiple of the tile and whose k ends in a partial chunk / partial scale block, against an fp64 CPU reference
// computed from the same weights decoded by src/formats. Outputs are poisoned with NaN first, so an unwritten
// element fails. Decoders are checked exhaustively over all codes. GPU tests skip without a CUDA driver; the
// argument checks run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/fp4_layout.h"
#include "cuda/gemm.h"
#include "cuda/gemv.h"
#include "cuda/gemv_launch.h"
#include "cuda/weight_tiles.h"
#include "dequant_probe.h"
#include "formats/fp4.h"
#include "formats/fp8.h"

namespace dsv4 {
namespace {

#define DSV4_REQUIRE_CUDA() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA driver or device"

// ---------------------------------------------------------------------------------------------------------
// Exhaustive decoder checks (bit-exact against src/formats).

bool same_value(float got, double want) { return double(got) == want && std::signbit(got) == std::signbit(want); }

TEST(CudaDequant, E4m3AllCodesAllFoldedScales) {
  DSV4_REQUIRE_CUDA();
  for (int e : {10, 100, 120, 127, 134}) {
    const std::vector<uint16_t> out = probe::decode_e4m3_codes(uint8_t(e));
    for (int code = 0; code < 256; ++code) {
      if ((code & 0x7f) == 0x7f) continue;  // NaN codes: no exactness claim (never in weights)
      const double want = double(e4m3_to_f32(uint8_t(code))) * std::ldexp(1.0, e - 127);
      EXPECT_TRUE(same_value(bf16_to_f32(out[size_t(code)]), want))
          << "e4m3 code 0x" << std::hex << code << std::dec << " with e8m0 " << e << ": got "
          << bf16_to_f32(out[size_t(code)]) << ", want " << want;
    }
  }
}

TEST(CudaDequant, E2m1AllBytesMxfp4Scales) {
  DSV4_REQUIRE_CUDA();
  for (int e : {2, 64, 118, 127, 128}) {
    const std::vector<uint16_t> out = probe::decode_e2m1_bytes_mx(uint8_t(e));
    for (int b = 0; b < 256; ++b)
      for (int half = 0; half < 2; ++half) {
        const uint8_t nib = uint8_t(half ? b >> 4 : b & 15);
        const double want = double(e2m1_to_f32(nib)) * std::ldexp(1.0, e - 127);
        const float got = bf16_to_f32(out[size_t(2 * b + half)]);
        EXPECT_TRUE(same_value(got, want)) << "byte " << b << " nibble " << half << " e8m0 " << e << ": got " << got
                                           << ", want " << want;
      }
  }
}

TEST(CudaDequant, E2m1AllBytesAllNvfp4Scales) {
  DSV4_REQUIRE_CUDA();
  int checked = 0;
  for (int s = 0; s < 256; ++s) {
    if ((s & 0x7f) == 0x7f) continue;
    const std::vector<uint16_t> out = probe::decode_e2m1_bytes_nv(uint8_t(s));
    for (int b = 0; b < 256; ++b)
      for (int half = 0; half < 2; ++half) {
        const uint8_t nib = uint8_t(half ? b >> 4 : b & 15);
        const double want = double(e2m1_to_f32(nib)) * double(e4m3_to_f32(uint8_t(s))) / 256.0;
        const float got = bf16_to_f32(out[size_t(2 * b + half)]);
        // Zero products: the sign of zero is not part of the contract (it vanishes in the dot product).
        const bool ok = want == 0.0 ? got == 0.0f : same_value(got, want);
        EXPECT_TRUE(ok) << "byte " << b << " nibble " << half << " scale 0x" << std::hex << s << std::dec
                        << ": got " << got << ", want " << want;
        ++checked;
      }
  }
  EXPECT_EQ(checked, 254 * 512);
}

// The kernels take their NVFP4 factors from nvfp4_factor_pair: the same bits as nvfp4_factor for every
// non-NaN scale code, in either byte of the pair.
TEST(CudaDequant, Nvfp4FactorPairMatchesSingle) {
  DSV4_REQUIRE_CUDA();
  const std::vector<uint32_t> f = probe::nvfp4_factors_both_ways();
  int checked = 0;
  for (int s = 0; s < 256; ++s) {
    const int high = 255 - s;
    if ((s & 0x7f) != 0x7f) {
      EXPECT_EQ(f[256 + size_t(s)], f[size_t(s)]) << "low byte 0x" << std::hex << s;
      // And the value itself, independently of nvfp4_factor: e4m3(s) * 2^118 in both halves.
      const float want = e4m3_to_f32(uint8_t(s)) * 0x1p118f;
      EXPECT_EQ(bf16_to_f32(uint16_t(f[256 + size_t(s)] & 0xffff)), want) << "code 0x" << std::hex << s;
      EXPECT_EQ(f[256 + size_t(s)] >> 16, f[256 + size_t(s)] & 0xffff);
      ++checked;
    }
    if ((high & 0x7f) != 0x7f) {
      EXPECT_EQ(f[512 + size_t(s)], f[size_t(high)]) << "high byte 0x" << std::hex << high;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 254);
}

// ---------------------------------------------------------------------------------------------------------
// GEMV against the fp64 reference.

struct Case {
  GemvWeight weight;
  GemvScale fp8_scale;
  int m, n, k;
  GemvOut out;
  int split_k;  // 0 = heuristic
  GemvAct act = GemvAct::BF16;
  bool bulk = false;  // fp4 weights through the copy engine (set_gemv_bulk)
  int tiled_min = 0;  // > 0: set_gemv_tiled_min_rows(tiled_min): decode-sized m on the tiled kernel (TiledMinScope)
  int wgmma = 0;  // fp4 weights in 64-row tiles: 0 as the engine chooses, kMmaSync, or wgmma shape 1..5 (KernelScope)
};

// set_gemv_bulk for one test, off again after it (also when an assertion returns early).
struct BulkScope {
  explicit BulkScope(bool on) { set_gemv_bulk(on); }
  ~BulkScope() { set_gemv_bulk(false); }
};

// set_gemv_tiled_min_rows for one case, whatever the grid size: its tiled_min, else kGemvMaxM + 1 (the skinny
// kernel up to 64 rows, as the other cases are written for); the default again after it.
struct TiledMinScope {
  explicit TiledMinScope(int rows) { set_gemv_tiled_min_rows(rows ? rows : kGemvMaxM + 1, 0); }
  ~TiledMinScope() { set_gemv_tiled_min_rows(kGemvTiledMinRowsDefault); }
};

// FP4 weights in the tiled kernel's 64-row tiles for one case: the engine's choice (0), the mma.sync kernel
// (kMmaSync), or the wgmma kernel with block shape 1..5 (detail::wgmma_shape); the defaults again after it.
constexpr int kMmaSync = -1;
struct KernelScope {
  explicit KernelScope(int kernel) {
    if (kernel == kMmaSync) set_gemv_wgmma(false);
    if (kernel > 0) detail::wgmma_shape = kernel;
  }
  ~KernelScope() {
    set_gemv_wgmma(kGemvWgmmaDefault);
    detail::wgmma_shape = 0;
  }
};

// The warp-specialised wgmma launches (shapes 4, 5) for one case: the walking kernel on `blocks` blocks (0: one per
// SM, the engine's), so that each block walks several tiles of a small grid, or the kernel of one block per tile
// (kPerTile, the default until the walking one is measured).
constexpr int kPerTile = -1;
// Restores the switch as it was (the default or DSV4_GEMV_WGMMA_PERSISTENT), so later tests run the engine's choice.
struct WalkScope {
  explicit WalkScope(int blocks) : was_on(gemv_wgmma_persistent_enabled()) {
    set_gemv_wgmma_persistent(blocks != kPerTile);
    detail::wgmma_walk_blocks = std::max(blocks, 0);
  }
  ~WalkScope() {
    set_gemv_wgmma_persistent(was_on);
    detail::wgmma_walk_blocks = 0;
  }
  const bool was_on;
};

// The W4A8 kernel on or off for act FP8 at m = 1, whatever the default (kGemvW4a8Default).
struct W4a8Scope {
  explicit W4a8Scope(bool on) { set_gemv_w4a8(on); }
  ~W4a8Scope() { set_gemv_w4a8(kGemvW4a8Default); }
};

std::string case_name(const Case& c) {
  std::string s = gemv_weight_name(c.weight);
  if (c.weight == GemvWeight::FP8_BLOCK) s += c.fp8_scale == GemvScale::E8M0 ? "_e8m0" : "_f32scale";
  s += "_m" + std::to_string(c.m) + "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k);
  s += c.out == GemvOut::F32 ? "_outf32" : "_outbf16";
  s += c.split_k ? "_split" + std::to_string(c.split_k) : "_auto";
  if (c.act == GemvAct::FP8) s += "_actfp8";
  if (c.bulk) s += "_bulk";
  if (c.tiled_min) s += "_tiledfrom" + std::to_string(c.tiled_min);
  if (c.wgmma) s += c.wgmma == kMmaSync ? "_mmasync" : "_wgmma" + std::to_string(c.wgmma);
  return s;
}

// x as the kernels see it: the bf16 values, quantised per row and 128-block for act FP8 (fp8_simulate_block).
std::vector<double> effective_x(const std::vector<uint16_t>& x, int rows, int k, GemvAct act) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_to_f32(x[i]);
  if (act == GemvAct::FP8)
    for (int r = 0; r < rows; ++r)
      for (int b = 0; b < k; b += 128) fp8_simulate_block(&f[size_t(r) * k + b], std::min(128, k - b));
  return {f.begin(), f.end()};
}

// Accumulation bound per sum|x w|: fp32 sums (1e-5), or 2^-13 where FP8 tensor-core partial sums are involved
// (their adders keep fewer bits than fp32; each 64- or 128-element partial is promoted to fp32).
double acc_bound_for(const GemvParams& p) { return gemv_uses_w4a8(p) ? 0x1p-13 : 1e-5; }

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

struct HostProblem {
  std::vector<uint16_t> x;      // [m, k] bf16
  std::vector<uint8_t> w, scale;
  float scale_2 = 1.0f;
  std::vector<double> w_deq;    // [n, k]
};

HostProblem make_problem(const Case& c, std::mt19937_64& rng) {
  HostProblem h;
  std::uniform_real_distribution<float> mag(0.05f, 1.0f);
  std::bernoulli_distribution neg(0.5);
  std::uniform_int_distribution<int> byte(0, 255);
  const size_t n = size_t(c.n), k = size_t(c.k);
  h.x.resize(size_t(c.m) * k);
  for (auto& v : h.x) v = f32_to_bf16((neg(rng) ? -2.0f : 2.0f) * mag(rng));
  h.w_deq.resize(n * k);
  auto nonzero_e4m3 = [&] {
    for (;;) {
      const int v = byte(rng);
      if ((v & 0x7f) != 0 && (v & 0x7f) != 0x7f) return uint8_t(v);
    }
  };
  auto nonzero_e2m1 = [&] {
    for (;;) {
      const int v = byte(rng) & 15;
      if ((v & 7) != 0) return uint8_t(v);
    }
  };
  switch (c.weight) {
    case GemvWeight::BF16: {
      h.w.resize(n * k * 2);
      for (size_t i = 0; i < n * k; ++i) {
        const uint16_t b = f32_to_bf16((neg(rng) ? -1.0f : 1.0f) * mag(rng));
        memcpy(&h.w[2 * i], &b, 2);
        h.w_deq[i] = bf16_to_f32(b);
      }
      break;
    }
    case GemvWeight::FP8_BLOCK: {
      const size_t sn = (n + 127) / 128, sk = (k + 127) / 128;
      std::vector<double> s(sn * sk);
      if (c.fp8_scale == GemvScale::E8M0) {
        h.scale.resize(sn * sk);
        std::uniform_int_distribution<int> e(118, 130);
        for (size_t i = 0; i < s.size(); ++i) {
          h.scale[i] = uint8_t(e(rng));
          s[i] = e8m0_to_f32(h.scale[i]);
        }
      } else {
        h.scale.resize(sn * sk * 4);
        std::uniform_real_distribution<float> f(1e-3f, 1e-1f);
        for (size_t i = 0; i < s.size(); ++i) {
          const float v = f(rng);
          memcpy(&h.scale[4 * i], &v, 4);
          s[i] = v;
        }
      }
      h.w.resize(n * k);
      for (size_t r = 0; r < n; ++r)
        for (size_t i = 0; i < k; ++i) {
          const uint8_t q = nonzero_e4m3();
          h.w[r * k + i] = q;
          h.w_deq[r * k + i] = double(e4m3_to_f32(q)) * s[(r / 128) * sk + i / 128];
        }
      break;
    }
    case GemvWeight::MXFP4:
    case GemvWeight::NVFP4: {
      const bool mx = c.weight == GemvWeight::MXFP4;
      const size_t block = mx ? 32 : 16, sk = k / block;
      h.scale.resize(n * sk);
      std::uniform_int_distribution<int> e(118, 128);
      for (auto& v : h.scale) v = mx ? uint8_t(e(rng)) : [&] {
        for (;;) {
          const int s = byte(rng) & 0x7f;  // positive, finite, not zero (subnormals included)
          if (s != 0 && s != 0x7f) return uint8_t(s);
        }
      }();
      if (!mx) h.scale_2 = std::uniform_real_distribution<float>(1e-3f, 1e-2f)(rng);
      h.w.resize(n * k / 2);
      for (size_t r = 0; r < n; ++r)
        for (size_t i = 0; i < k; i += 2) {
          const uint8_t lo = nonzero_e2m1(), hi = nonzero_e2m1();
          h.w[(r * k + i) / 2] = uint8_t(lo | hi << 4);
          const uint8_t sc = h.scale[r * sk + i / block];
          const double s = mx ? double(e8m0_to_f32(sc)) : double(e4m3_to_f32(sc)) * double(h.scale_2);
          h.w_deq[r * k + i] = double(e2m1_to_f32(lo)) * s;
          h.w_deq[r * k + i + 1] = double(e2m1_to_f32(hi)) * s;
        }
      fp4_layout::bytes_to_device(h.w.data(), h.w.size());  // the kernels' bit order (gemv.h)
      break;
    }
  }
  return h;
}

class GemvTest : public ::testing::TestWithParam<Case> {};

TEST_P(GemvTest, MatchesFp64Reference) {
  DSV4_REQUIRE_CUDA();
  const Case c = GetParam();
  const uint64_t seed = std::random_device{}() ^ std::hash<std::string>{}(case_name(c));
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const HostProblem h = make_problem(c, rng);

  DeviceBuffer x(h.x.size() * 2), w(h.w.size()), scale(h.scale.size()), y(size_t(c.m) * c.n * 4),
      act_scratch(h.x.size() * 2);
  x.upload(h.x.data(), h.x.size() * 2);
  w.upload(h.w.data(), h.w.size());
  if (!h.scale.empty()) scale.upload(h.scale.data(), h.scale.size());
  y.fill_bytes(0xff);  // NaN in both output types

  GemvParams p;
  p.m = c.m, p.n = c.n, p.k = c.k;
  p.x = x.data(), p.w = w.data(), p.w_scale = h.scale.empty() ? nullptr : scale.data();
  p.w_scale_2 = h.scale_2, p.y = y.data();
  p.weight = c.weight, p.fp8_scale = c.fp8_scale, p.out = c.out, p.split_k = c.split_k;
  p.act = c.act, p.act_scratch = act_scratch.data();
  const BulkScope bulk(c.bulk);
  if (c.bulk) {
    ASSERT_TRUE(detail::gemv_bulk_supported(p) || detail::gemv_w4a8_bulk_supported(p))
        << "the case must run a copy-engine kernel";
  }
  const TiledMinScope tiled_min(c.tiled_min);
  if (c.tiled_min) ASSERT_TRUE(detail::gemv_tiled_supported(p)) << "the case must run the tiled kernel";
  const KernelScope kernel(c.wgmma);
  gemv(p);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<double> xq = effective_x(h.x, c.m, c.k, c.act);

  std::vector<float> got(size_t(c.m) * c.n);
  if (c.out == GemvOut::F32) {
    y.download(got.data(), got.size() * 4);
  } else {
    std::vector<uint16_t> raw(got.size());
    y.download(raw.data(), raw.size() * 2);
    for (size_t i = 0; i < raw.size(); ++i) got[i] = bf16_to_f32(raw[i]);
  }

  // Bounds: fp32 output  |y - ref| <= 1e-5 * sum|x w|, and ||y - ref|| / ||ref|| <= 1e-5;
  //         bf16 output  |y - ref| <= 4e-3 * |ref| + 1e-5 * sum|x w|, and the norm-wise error <= 4e-3.
  const bool bf16_out = c.out == GemvOut::BF16;
  const double acc_bound = acc_bound_for(p);
  // fp32 rounding of one k-long chain grows like sqrt(k): 1e-5 up to k = 2048, then by sqrt(k / 2048) (k = 8192 at
  // split 1 measured 1.03e-5 once on the H100, random inputs).
  const double chain = std::max(1.0, std::sqrt(c.k / 2048.0));
  const double rel_bound = bf16_out ? 4e-3 : 0.0, norm_bound = bf16_out ? 4e-3 : acc_bound * chain;
  double err2 = 0, ref2 = 0, worst_ratio = 0;
  int unwritten = 0, bad = 0;
  for (int mi = 0; mi < c.m; ++mi)
    for (int ni = 0; ni < c.n; ++ni) {
      double ref = 0, absum = 0;
      const double* xr = &xq[size_t(mi) * c.k];
      const double* wr = &h.w_deq[size_t(ni) * c.k];
      for (int ki = 0; ki < c.k; ++ki) {
        const double t = xr[ki] * wr[ki];
        ref += t;
        absum += std::fabs(t);
      }
      const float v = got[size_t(mi) * c.n + ni];
      if (!std::isfinite(v)) {
        ++unwritten;
        continue;
      }
      const double err = std::fabs(double(v) - ref), allowed = rel_bound * std::fabs(ref) + acc_bound * absum;
      worst_ratio = std::max(worst_ratio, err / allowed);
      if (err > allowed && ++bad <= 5)
        ADD_FAILURE() << "y[" << mi << ", " << ni << "] = " << v << ", reference " << ref << " (allowed error "
                      << allowed << ")";
      err2 += (double(v) - ref) * (double(v) - ref);
      ref2 += ref * ref;
    }
  EXPECT_EQ(unwritten, 0) << "non-finite (unwritten) outputs";
  EXPECT_EQ(bad, 0);
  const double normwise = std::sqrt(err2 / ref2);
  EXPECT_LE(normwise, norm_bound);
  std::printf("[gemv] %-48s normwise %.2e  worst err/allowed %.3f\n", case_name(c).c_str(), normwise, worst_ratio);
}

std::vector<Case> all_cases() {
  struct FormatCase {
    GemvWeight w;
    GemvScale s;
    int k_wide, k_deep, k_tall;  // k not a multiple of the chunk (or of the 128 scale block)
  };
  const FormatCase formats[] = {
      {GemvWeight::BF16, GemvScale::E8M0, 1000, 4104, 64},
      {GemvWeight::FP8_BLOCK, GemvScale::E8M0, 1040, 4112, 64},
      {GemvWeight::FP8_BLOCK, GemvScale::F32, 1040, 4112, 64},
      {GemvWeight::MXFP4, GemvScale::E8M0, 1056, 4128, 64},
      {GemvWeight::NVFP4, GemvScale::E8M0, 1056, 4128, 64},
  };
  std::vector<Case> cases;
  for (const FormatCase& f : formats) {
    for (int m : {1, 3, 8, 13, 29, 64}) {  // 13 and 29 reach the 2- and 4-n-tile kernels
      cases.push_back({f.w, f.s, m, 301, f.k_wide, GemvOut::F32, 0});
      cases.push_back({f.w, f.s, m, 45, f.k_deep, GemvOut::F32, 0});  // few tiles: split_k 8
    }
    for (int m : {3, 64}) {
      cases.push_back({f.w, f.s, m, 301, f.k_wide, GemvOut::BF16, 0});
      cases.push_back({f.w, f.s, m, 45, f.k_deep, GemvOut::BF16, 0});
    }
    for (int split : {1, 2, 4, 8}) cases.push_back({f.w, f.s, 8, 301, f.k_wide, GemvOut::F32, split});
    for (int m : {1, 64}) cases.push_back({f.w, f.s, m, 34000, f.k_tall, GemvOut::F32, 0});  // many tiles: split 1
    // m > 64: the tiled kernel (partial row and weight tiles, k not a multiple of its chunk, several row tiles)
    for (int m : {65, 130, 200}) {
      cases.push_back({f.w, f.s, m, 301, f.k_wide, GemvOut::F32, 0});
      cases.push_back({f.w, f.s, m, 45, f.k_deep, GemvOut::F32, 0});
    }
    cases.push_back({f.w, f.s, 130, 301, f.k_wide, GemvOut::BF16, 0});
    cases.push_back({f.w, f.s, 300, 600, 512, GemvOut::F32, 0});
    // The same grids are too small for the engine to choose wgmma: its block shapes forced (partial row and token
    // tiles, several token tiles, a second pass: m = 300 over 128-row tiles; decode batches of 33..64 rows).
    if (f.w == GemvWeight::MXFP4 || f.w == GemvWeight::NVFP4)
      for (int shape : {3, 1, 4, 5}) {
        for (int m : {65, 130, 300}) {
          cases.push_back({f.w, f.s, m, 301, f.k_wide, GemvOut::F32, 0, GemvAct::BF16, false, 0, shape});
          cases.push_back({f.w, f.s, m, 45, f.k_deep, GemvOut::BF16, 0, GemvAct::BF16, false, 0, shape});
        }
        cases.push_back({f.w, f.s, 33, 301, f.k_wide, GemvOut::F32, 0, GemvAct::BF16, false, 2, shape});
        cases.push_back({f.w, f.s, 64, 45, f.k_deep, GemvOut::F32, 0, GemvAct::BF16, false, 2, shape});
      }
    // Decode batches on the tiled kernel (set_gemv_tiled_min_rows): its 16- and 32-row activation tiles, partly
    // filled, and the 64-row one at m <= 64; bf16 / fp8 rows leave threads without an activation copy.
    if (f.s == GemvScale::E8M0)
      for (int m : {4, 9, 16, 17, 32, 33, 64}) {  // bf16 weights from 2 x 2 rows
        cases.push_back({f.w, f.s, m, 301, f.k_wide, GemvOut::F32, 0, GemvAct::BF16, false, 2});
        cases.push_back({f.w, f.s, m, 45, f.k_deep, GemvOut::BF16, 0, GemvAct::BF16, false, 2});
      }
    cases.push_back({f.w, f.s, 130, 301, f.k_wide, GemvOut::F32, 0, GemvAct::FP8});
    // act FP8: the W4A8 kernel (fp4 weights, m = 1) or x quantised into act_scratch first (everything else)
    for (int m : {1, 3, 64}) {
      cases.push_back({f.w, f.s, m, 301, f.k_wide, GemvOut::F32, 0, GemvAct::FP8});
      cases.push_back({f.w, f.s, m, 45, f.k_deep, GemvOut::F32, 0, GemvAct::FP8});
    }
    if (f.w == GemvWeight::MXFP4 || f.w == GemvWeight::NVFP4) {
      cases.push_back({f.w, f.s, 1, 301, f.k_wide, GemvOut::BF16, 0, GemvAct::FP8});
      cases.push_back({f.w, f.s, 1, 34000, f.k_tall, GemvOut::F32, 0, GemvAct::FP8});
      for (int split : {1, 2, 4, 8}) cases.push_back({f.w, f.s, 1, 301, f.k_wide, GemvOut::F32, split, GemvAct::FP8});
    }
    if (f.w != GemvWeight::BF16) {
      // The copy-engine kernel (k a multiple of 512 for fp4, 256 for fp8): every n-tile count, partial tiles, warps
      // with no stage (split 4 and 8 over 3 fp4 stages), one stage, a ring wrapped five times (16 or 32 stages at
      // split 1), quantised x.
      const GemvAct a = GemvAct::BF16;
      for (int m : {1, 3, 8, 13, 29, 64}) {
        cases.push_back({f.w, f.s, m, 301, 1024, GemvOut::F32, 0, a, true});
        cases.push_back({f.w, f.s, m, 45, 4096, GemvOut::F32, 0, a, true});
      }
      for (int m : {3, 64}) cases.push_back({f.w, f.s, m, 301, 1024, GemvOut::BF16, 0, a, true});
      for (int split : {1, 2, 4, 8}) cases.push_back({f.w, f.s, 8, 301, 1536, GemvOut::F32, split, a, true});
      for (int m : {1, 64}) cases.push_back({f.w, f.s, m, 34000, 512, GemvOut::F32, 0, a, true});
      cases.push_back({f.w, f.s, 1, 301, 8192, GemvOut::F32, 1, a, true});
      cases.push_back({f.w, f.s, 8, 45, 8192, GemvOut::F32, 2, a, true});
      cases.push_back({f.w, f.s, 3, 301, 1024, GemvOut::F32, 0, GemvAct::FP8, true});
      if (f.w != GemvWeight::FP8_BLOCK) {  // the W4A8 kernel's copy-engine variant (act fp8, m = 1)
        const GemvAct a8 = GemvAct::FP8;
        cases.push_back({f.w, f.s, 1, 301, 1024, GemvOut::F32, 0, a8, true});
        cases.push_back({f.w, f.s, 1, 301, 1024, GemvOut::BF16, 0, a8, true});
        cases.push_back({f.w, f.s, 1, 34000, 512, GemvOut::F32, 0, a8, true});
        cases.push_back({f.w, f.s, 1, 301, 8192, GemvOut::F32, 1, a8, true});
        for (int split : {1, 2, 4, 8}) cases.push_back({f.w, f.s, 1, 301, 1536, GemvOut::F32, split, a8, true});
      }
      if (f.w == GemvWeight::FP8_BLOCK) {  // one and three 256-weight stages
        cases.push_back({f.w, f.s, 1, 301, 256, GemvOut::F32, 0, a, true});
        cases.push_back({f.w, f.s, 8, 301, 768, GemvOut::F32, 2, a, true});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllFormats, GemvTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); });

// ---------------------------------------------------------------------------------------------------------
// One plain gemv problem on the device (c's weights, shape, split and activations; fp32 y), run under several
// settings; outputs holds each run's y.
struct VariantRuns {
  VariantRuns(const Case& c, std::mt19937_64& rng)
      : h(make_problem(c, rng)), x(h.x.size() * 2), dw(h.w.size()), ds(std::max<size_t>(h.scale.size(), 16)),
        y(size_t(c.m) * c.n * 4) {
    x.upload(h.x.data(), h.x.size() * 2);
    dw.upload(h.w.data(), h.w.size());
    if (!h.scale.empty()) ds.upload(h.scale.data(), h.scale.size());
    p.m = c.m, p.n = c.n, p.k = c.k, p.x = x.data(), p.w = dw.data(), p.w_scale = ds.data();
    p.w_scale_2 = h.scale_2, p.y = y.data(), p.weight = c.weight, p.fp8_scale = c.fp8_scale;
    p.split_k = c.split_k, p.act = c.act;
  }
  void run() {
    y.fill_bytes(0xff);
    gemv(p);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    outputs.emplace_back(size_t(p.m) * p.n);
    y.download(outputs.back().data(), outputs.back().size() * 4);
  }
  bool all_equal() const {
    for (const std::vector<float>& o : outputs)
      if (std::memcmp(o.data(), outputs[0].data(), o.size() * 4) != 0) return false;
    return true;
  }
  HostProblem h;
  DeviceBuffer x, dw, ds, y;
  GemvParams p;
  std::vector<std::vector<float>> outputs;
};

// The tiled kernel's variant with one 16-row weight tile per warp (two blocks per SM) computes every output with
// the same k order as the default one, so the two agree bit for bit (the default is checked against fp64 above).
TEST(GemvTiled, WeightTileVariantsAgreeBitForBit) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(77);
  for (const auto& [w, s] : {std::pair{GemvWeight::BF16, GemvScale::E8M0}, {GemvWeight::FP8_BLOCK, GemvScale::E8M0},
                             {GemvWeight::MXFP4, GemvScale::E8M0}, {GemvWeight::NVFP4, GemvScale::E8M0}})
    for (const auto& [m, n, k] : {std::tuple{130, 301, 1056}, {300, 600, 512}, {65, 45, 4128}}) {
      VariantRuns v(Case{w, s, m, n, k, GemvOut::F32, 0}, rng);
      const KernelScope kernel(kMmaSync);  // the variants are of the mma.sync kernel
      for (int tiles : {2, 1}) {
        detail::tiled_weight_tiles = tiles;
        v.run();
      }
      detail::tiled_weight_tiles = 0;
      EXPECT_TRUE(v.all_equal()) << gemv_weight_name(w) << " m " << m << " n " << n << " k " << k;
    }
}

// The wgmma kernel's block shapes (256 x 64, 128 x 128, 256 x 128; warp-specialised 256 x 128 and 256 x 64) run the
// same wgmma k16 steps in the same order for every output, so they agree bit for bit (the default shape is checked
// against fp64 above); so do the warp-specialised ones whatever the number of tiles each block walks.
TEST(GemvWgmma, BlockShapesAgreeBitForBit) {
  DSV4_REQUIRE_CUDA();
  if (!gemv_wgmma_enabled()) GTEST_SKIP() << "no wgmma on this device";
  std::mt19937_64 rng(78);
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    for (const auto& [m, n, k] : {std::tuple{130, 301, 1056}, {300, 600, 512}, {65, 45, 4128}, {33, 520, 256}}) {
      VariantRuns v(Case{w, GemvScale::E8M0, m, n, k, GemvOut::F32, 0}, rng);
      const TiledMinScope tiled_min(m <= kGemvMaxM ? 2 : 0);
      for (int shape : {1, 2, 3, 4, 5}) {
        detail::wgmma_shape = shape;
        for (int walk : shape >= 4 ? std::vector<int>{0, 1, 2, 3, kPerTile} : std::vector<int>{0}) {
          const WalkScope walkers(walk);
          v.run();
        }
      }
      detail::wgmma_shape = 0;
      EXPECT_TRUE(v.all_equal()) << gemv_weight_name(w) << " m " << m << " n " << n << " k " << k;
    }
}

// Which prefill-sized dense linears skip the weight decode + cuBLASLt for the wgmma kernel: fp4 weights, bf16
// activations, 64 < m < 1024, and a grid with a block for ~every SM (the runner's dense()).
TEST(GemvWgmma, DenseLinearsThatBeatCublas) {
  DSV4_REQUIRE_CUDA();
  if (!gemv_wgmma_enabled()) GTEST_SKIP() << "no wgmma on this device";
  auto params = [](GemvWeight w, int m, int n, int k) {
    GemvParams p;
    p.weight = w, p.m = m, p.n = n, p.k = k;
    return p;
  };
  const bool small_gpu = current_sm_count() * 7 / 8 <= 32;  // 1024 rows x 512 tokens: 32 blocks of 256 x 64
  EXPECT_TRUE(gemv_beats_decode_and_gemm(params(GemvWeight::NVFP4, 512, 32768, 1024)));
  EXPECT_TRUE(gemv_beats_decode_and_gemm(params(GemvWeight::MXFP4, 512, 32768, 1024)));
  EXPECT_EQ(gemv_beats_decode_and_gemm(params(GemvWeight::NVFP4, 512, 1024, 4096)), small_gpu);
  EXPECT_FALSE(gemv_beats_decode_and_gemm(params(GemvWeight::NVFP4, 1024, 32768, 1024)));  // cuBLASLt from 1024
  EXPECT_FALSE(gemv_beats_decode_and_gemm(params(GemvWeight::NVFP4, 64, 32768, 1024)));    // the skinny kernel
  EXPECT_FALSE(gemv_beats_decode_and_gemm(params(GemvWeight::BF16, 512, 32768, 1024)));
  EXPECT_FALSE(gemv_beats_decode_and_gemm(params(GemvWeight::FP8_BLOCK, 512, 32768, 1024)));
  GemvParams fp8_act = params(GemvWeight::NVFP4, 512, 32768, 1024);
  fp8_act.act = GemvAct::FP8;
  EXPECT_FALSE(gemv_beats_decode_and_gemm(fp8_act));
  set_gemv_wgmma_ws(false);
  EXPECT_FALSE(gemv_beats_decode_and_gemm(params(GemvWeight::NVFP4, 512, 32768, 1024)));
  set_gemv_wgmma_ws(kGemvWgmmaWsDefault);
  set_gemv_over_gemm(false);
  EXPECT_FALSE(gemv_beats_decode_and_gemm(params(GemvWeight::NVFP4, 512, 32768, 1024)));
  set_gemv_over_gemm(true);
}

// At split_k 1 the copy-engine kernel walks k in the register kernel's order (one warp per tile, chunks in order,
// the same mma sequence), so the two agree bit for bit; with more warps per tile only the split-k partition differs
// (checked against fp64 above).
TEST(GemvBulk, MatchesRegisterKernelBitForBitAtSplit1) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(91);
  for (const auto& [w, s] : {std::pair{GemvWeight::MXFP4, GemvScale::E8M0}, {GemvWeight::NVFP4, GemvScale::E8M0},
                             {GemvWeight::FP8_BLOCK, GemvScale::E8M0}, {GemvWeight::FP8_BLOCK, GemvScale::F32}})
    for (const auto& [m, n, k] : {std::tuple{1, 301, 2048}, {8, 64, 4096}, {29, 301, 512}, {64, 45, 1536}}) {
      VariantRuns v(Case{w, s, m, n, k, GemvOut::F32, 1}, rng);
      for (const bool on : {false, true}) {
        const BulkScope bulk(on);
        ASSERT_EQ(detail::gemv_bulk_supported(v.p), on);
        v.run();
      }
      EXPECT_TRUE(v.all_equal()) << gemv_weight_name(w) << " m " << m << " n " << n << " k " << k;
    }
  // The W4A8 kernel (act fp8, m = 1) and its copy-engine variant, likewise.
  const W4a8Scope w4a8(true);
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    for (const auto& [n, k] : {std::pair{301, 2048}, {64, 4096}, {45, 512}}) {
      VariantRuns v(Case{w, GemvScale::E8M0, 1, n, k, GemvOut::F32, 1, GemvAct::FP8}, rng);
      for (const bool on : {false, true}) {
        const BulkScope bulk(on);
        ASSERT_TRUE(gemv_uses_w4a8(v.p));
        ASSERT_EQ(detail::gemv_w4a8_bulk_supported(v.p), on);
        v.run();
      }
      EXPECT_TRUE(v.all_equal()) << "w4a8 " << gemv_weight_name(w) << " n " << n << " k " << k;
    }
}

// The tile layout (weight_tiles.h) moves bytes only: every lane loads the same pieces, so plain, batched and grouped
// launches give the row-major results bit for bit, at every split and n-tile width.
struct TiledCopy {
  std::vector<uint8_t> w, scale;
};
TiledCopy to_tiles(const HostProblem& h, GemvWeight w, int n, int k) {
  const size_t piece = w == GemvWeight::NVFP4 ? 2 : 1;
  TiledCopy t{std::vector<uint8_t>(h.w.size()), std::vector<uint8_t>(h.scale.size())};
  weight_tiles::from_rows(h.w.data(), t.w.data(), size_t(n), size_t(k) / 2, weight_tiles::kWeightPiece);
  weight_tiles::from_rows(h.scale.data(), t.scale.data(), size_t(n), size_t(k) / 32 * piece, piece);
  return t;
}

// A problem's x and its weights on the device in both layouts.
struct BothLayouts {
  DeviceBuffer x, rows_w, rows_scale, tiles_w, tiles_scale;
  BothLayouts(const HostProblem& h, const TiledCopy& t)
      : x(h.x.size() * 2), rows_w(h.w.size()), rows_scale(h.scale.size()), tiles_w(t.w.size()),
        tiles_scale(t.scale.size()) {
    x.upload(h.x.data(), h.x.size() * 2);
    rows_w.upload(h.w.data(), h.w.size());
    rows_scale.upload(h.scale.data(), h.scale.size());
    tiles_w.upload(t.w.data(), t.w.size());
    tiles_scale.upload(t.scale.data(), t.scale.size());
  }
};

// gemv(p) into y (NaN-filled first), its first `count` floats.
std::vector<float> run_gemv(const GemvParams& p, DeviceBuffer& y, size_t count) {
  y.fill_bytes(0xff);
  gemv(p);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out(count);
  y.download(out.data(), count * 4);
  return out;
}

// Batched (wo_a's form: each batch's n rows start a tile): the tile layout gives the row-major bits; bulk: both
// through the copy-engine kernel (set_gemv_bulk, asserted).
void expect_batched_tiles_match_rows(GemvWeight w, std::mt19937_64& rng, bool bulk = false) {
  const int batch = 8, n = 48, k = 1024, m = 1;
  const HostProblem h = make_problem({w, GemvScale::E8M0, m * batch, batch * n, k, GemvOut::F32, 0}, rng);
  const BothLayouts d(h, to_tiles(h, w, batch * n, k));
  DeviceBuffer y(size_t(batch) * n * 4);
  const BulkScope scope(bulk);
  std::vector<std::vector<float>> got;
  for (const bool tiled : {false, true}) {
    GemvBatchedParams b;
    b.base.m = m, b.base.n = n, b.base.k = k, b.base.x = d.x.data();
    b.base.w = tiled ? d.tiles_w.data() : d.rows_w.data();
    b.base.w_scale = tiled ? d.tiles_scale.data() : d.rows_scale.data(), b.base.w_scale_2 = h.scale_2;
    b.base.y = y.data();
    b.base.weight = w, b.base.layout = tiled ? GemvLayout::Tiles : GemvLayout::Rows, b.base.ldy = batch * n;
    b.batch = batch, b.x_batch_stride = int64_t(m) * k, b.y_batch_stride = n;
    if (bulk) {
      ASSERT_TRUE(detail::gemv_bulk_supported(b.base)) << "tiled " << tiled;
    }
    y.fill_bytes(0xff);
    gemv_batched(b);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    got.emplace_back(size_t(batch) * n);
    y.download(got.back().data(), got.back().size() * 4);
  }
  EXPECT_EQ(0, std::memcmp(got[0].data(), got[1].data(), got[0].size() * 4)) << "batched " << gemv_weight_name(w);
}

TEST(GemvTiles, OffsetsArePermutations) {
  for (const auto& [rows, row_bytes, piece] : {std::tuple{16, 64, 16}, {48, 2048, 16}, {32, 256, 2}, {16, 128, 1}}) {
    std::vector<int> hit(size_t(rows) * row_bytes, 0);
    for (int r = 0; r < rows; ++r)
      for (int b = 0; b < row_bytes; ++b) {
        const size_t o = weight_tiles::offset(size_t(r), size_t(b), size_t(row_bytes), size_t(piece));
        ASSERT_LT(o, hit.size());
        ++hit[o];
        ASSERT_EQ(o / (16 * size_t(row_bytes)), size_t(r / 16)) << "a byte left its tile";
        const weight_tiles::RowByte back = weight_tiles::position(o, size_t(row_bytes), size_t(piece));
        ASSERT_EQ(back.row, size_t(r)) << "position() must invert offset()";
        ASSERT_EQ(back.byte, size_t(b));
      }
    EXPECT_EQ(std::count(hit.begin(), hit.end(), 1), int(hit.size())) << rows << " x " << row_bytes;
  }
  // Lane l's piece of chunk 0, row l / 4 (lo) and l / 4 + 8 (hi), at l * 16 and 512 + l * 16.
  EXPECT_EQ(weight_tiles::offset(3, 2 * 16 + 5, 2048, 16), size_t((3 * 4 + 2) * 16 + 5));
  EXPECT_EQ(weight_tiles::offset(11, 64 + 16, 2048, 16), size_t(1024 + 512 + 13 * 16));
}

// Grouped with a second projection (the experts' w1 + w3): `tokens` x 6 picks of 9 experts, n x k weights per
// expert in both layouts; under each of `kernels` (KernelScope) the tile layout gives the row-major bits.
// bulk: both through the copy-engine kernel (set_gemv_bulk, asserted), whose stages are one copy per tile on tiles.
void expect_grouped_tiles_match_rows(GemvWeight w, int tokens, int n, int k, const std::vector<int>& kernels,
                                     std::mt19937_64& rng, bool bulk = false) {
  const int E = 9, picks = 6, pairs = tokens * picks;
  const size_t ws = size_t(gemv_weight_bytes(w, n, k)), ss = size_t(gemv_scale_bytes(w, n, k));
  DeviceBuffer x(size_t(tokens) * k * 2), dw(2 * E * ws), ds(2 * E * ss), tw(2 * E * ws), ts(2 * E * ss),
      s2(2 * E * 4), ids(pairs * 4), y(2 * size_t(pairs) * n * 4), count(4), slot_expert(E * 4),
      slot_offset((E + 1) * 4), order(pairs * 4);
  std::vector<float> scale_2;
  for (int e = 0; e < 2 * E; ++e) {
    const HostProblem h = make_problem({w, GemvScale::E8M0, e == 0 ? tokens : 1, n, k, GemvOut::F32, 0}, rng);
    if (e == 0) x.upload(h.x.data(), h.x.size() * 2);
    const TiledCopy t = to_tiles(h, w, n, k);
    dw.upload(h.w.data(), ws, e * ws), ds.upload(h.scale.data(), ss, e * ss);
    tw.upload(t.w.data(), ws, e * ws), ts.upload(t.scale.data(), ss, e * ss);
    scale_2.push_back(h.scale_2);
  }
  s2.upload(scale_2.data(), scale_2.size() * 4);
  std::vector<int32_t> h_ids(pairs);
  for (int i = 0; i < pairs; ++i) h_ids[size_t(i)] = (i * 5 + i / picks) % E;
  ids.upload(h_ids.data(), h_ids.size() * 4);
  MoeSlotsParams sp;
  sp.ids = ids.as<int32_t>(), sp.n = tokens, sp.k = picks, sp.experts = E;
  sp.slots = {count.as<int32_t>(), slot_expert.as<int32_t>(), slot_offset.as<int32_t>(), order.as<int32_t>()};
  moe_slots(sp);
  for (const int kernel : kernels) {
    const KernelScope scope(kernel);
    std::vector<std::vector<float>> got;
    for (const bool tiled : {false, true}) {
      GemvGroupedParams g;
      g.base.m = tokens, g.base.n = n, g.base.k = k, g.base.x = x.data(), g.base.y = y.data(), g.base.weight = w;
      g.base.w = tiled ? tw.data() : dw.data(), g.base.w_scale = tiled ? ts.data() : ds.data();
      g.base.layout = tiled ? GemvLayout::Tiles : GemvLayout::Rows;
      g.w_expert_stride = ws, g.scale_expert_stride = ss, g.scale_2 = s2.as<float>(), g.max_slots = E;
      g.slots = sp.slots, g.x_row_div = picks;
      g.second.w = (tiled ? tw.as<char>() : dw.as<char>()) + E * ws;
      g.second.w_scale = (tiled ? ts.as<char>() : ds.as<char>()) + E * ss;
      g.second.scale_2 = s2.as<float>() + E, g.second.y = y.as<float>() + size_t(pairs) * n;
      const BulkScope bulk_scope(bulk);
      if (bulk) {
        ASSERT_EQ(int(detail::grouped_kernel(g)), int(detail::GroupedKernel::Bulk)) << "tiled " << tiled;
      }
      y.fill_bytes(0xff);
      gemv_grouped(g);
      DSV4_CUDA_CHECK(cudaDeviceSynchronize());
      got.emplace_back(2 * size_t(pairs) * n);
      y.download(got.back().data(), got.back().size() * 4);
    }
    ASSERT_TRUE(std::all_of(got[0].begin(), got[0].end(), [](float v) { return std::isfinite(v); }));
    EXPECT_EQ(0, std::memcmp(got[0].data(), got[1].data(), got[0].size() * 4))
        << "grouped " << gemv_weight_name(w) << " tokens " << tokens << " kernel " << kernel;
  }
}

TEST(GemvTiles, SameBitsAsRowMajor) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(123);
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    for (const auto& [m, n, k] : {std::tuple{1, 304, 4096}, {5, 48, 1152}, {8, 2048, 512}, {16, 64, 2048},
                                  {33, 96, 1024}, {64, 32, 640}, {100, 272, 1024}, {300, 528, 640}})
      for (const int split : {0, 1, 2, 8}) {  // (m > 64: the tiled kernel, which has no split)
        if (m > kGemvMaxM && split > 1) continue;
        const Case c{w, GemvScale::E8M0, m, n, k, GemvOut::F32, split};
        const HostProblem h = make_problem(c, rng);
        const BothLayouts d(h, to_tiles(h, w, n, k));
        DeviceBuffer y(size_t(m) * n * 4);
        // m > 64: also each wgmma block shape forced (these grids are too small for the engine's rule, and the
        // engine's prefill runs those kernels on tiles).
        const bool shapes = m > kGemvMaxM && split == 0;
        for (const int kernel : shapes ? std::vector<int>{0, 1, 3, 4, 5} : std::vector<int>{0}) {
          const KernelScope scope(kernel);
          GemvParams p;
          p.m = m, p.n = n, p.k = k, p.x = d.x.data(), p.w = d.rows_w.data(), p.w_scale = d.rows_scale.data();
          p.w_scale_2 = h.scale_2, p.y = y.data(), p.weight = w, p.split_k = split;
          const std::vector<float> rows = run_gemv(p, y, size_t(m) * n);
          GemvParams q = p;
          q.w = d.tiles_w.data(), q.w_scale = d.tiles_scale.data(), q.layout = GemvLayout::Tiles;
          const std::vector<float> tiles = run_gemv(q, y, size_t(m) * n);
          ASSERT_TRUE(std::all_of(rows.begin(), rows.end(), [](float v) { return std::isfinite(v); }));
          EXPECT_EQ(0, std::memcmp(rows.data(), tiles.data(), rows.size() * 4)) << case_name(c) << " kernel " << kernel;
          // A 16-row-aligned slice of the tiled matrix (w_row0) is the same rows.
          if (n >= 32) {
            q.w_row0 = 16, q.n = n - 16, p.w_row0 = 16, p.n = n - 16;
            const std::vector<float> a = run_gemv(p, y, size_t(m) * (n - 16)), b = run_gemv(q, y, size_t(m) * (n - 16));
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4))
                << case_name(c) << " kernel " << kernel << " w_row0 16";
          }
        }
      }
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4}) expect_batched_tiles_match_rows(w, rng);
  // Grouped with a second projection (the experts' w1 + w3): 3 tokens x 6 picks of 9 experts; then 40 tokens (~27
  // rows a slot, partial 256-row blocks) on the wgmma kernels, each block shape forced.
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    expect_grouped_tiles_match_rows(w, 3, 64, 2048, {0}, rng);
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    expect_grouped_tiles_match_rows(w, 40, 272, 1024, {1, 3, 4, 5}, rng);
}

// The copy-engine kernel on tiles (one weight copy and one scale copy per stage) reads the row-major kernel's bytes
// into the same registers: bit for bit the copy-engine kernel on rows at every split (the same contiguous k range per
// warp), plain, sliced (w_row0), batched and grouped; and at split 1 the register kernel on tiles.
TEST(GemvTiles, CopyEngineSameBitsAsRowMajor) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(321);
  auto run = [](const GemvParams& p, bool bulk, DeviceBuffer& y, size_t count) {
    const BulkScope scope(bulk);
    EXPECT_EQ(detail::gemv_bulk_supported(p), bulk);
    return run_gemv(p, y, count);
  };
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    for (const auto& [m, n, k] : {std::tuple{1, 304, 4096}, {8, 2048, 512}, {16, 64, 2048}, {29, 96, 1024},
                                  {64, 32, 1536}, {3, 4096, 8192}})
      for (const int split : {0, 1, 2, 8}) {
        const Case c{w, GemvScale::E8M0, m, n, k, GemvOut::F32, split};
        const HostProblem h = make_problem(c, rng);
        const BothLayouts d(h, to_tiles(h, w, n, k));
        DeviceBuffer y(size_t(m) * n * 4);
        GemvParams p;
        p.m = m, p.n = n, p.k = k, p.x = d.x.data(), p.w = d.rows_w.data(), p.w_scale = d.rows_scale.data();
        p.w_scale_2 = h.scale_2, p.y = y.data(), p.weight = w, p.split_k = split;
        GemvParams q = p;
        q.w = d.tiles_w.data(), q.w_scale = d.tiles_scale.data(), q.layout = GemvLayout::Tiles;
        const std::vector<float> rows = run(p, true, y, size_t(m) * n), tiles = run(q, true, y, size_t(m) * n);
        ASSERT_TRUE(std::all_of(rows.begin(), rows.end(), [](float v) { return std::isfinite(v); }));
        EXPECT_EQ(0, std::memcmp(rows.data(), tiles.data(), rows.size() * 4)) << case_name(c);
        if (split == 1) {
          const std::vector<float> reg = run(q, false, y, size_t(m) * n);
          EXPECT_EQ(0, std::memcmp(reg.data(), tiles.data(), reg.size() * 4)) << case_name(c) << " register kernel";
        }
        q.w_row0 = 16, q.n = n - 16, p.w_row0 = 16, p.n = n - 16;
        const std::vector<float> a = run(p, true, y, size_t(m) * (n - 16)), b = run(q, true, y, size_t(m) * (n - 16));
        EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << case_name(c) << " w_row0 16";
      }
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4}) expect_batched_tiles_match_rows(w, rng, true);
  // Grouped w1 + w3: 3 tokens x 6 picks of 9 experts; 20 tokens put ~13 rows in a slot (two n-tiles).
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4}) {
    expect_grouped_tiles_match_rows(w, 3, 64, 2048, {0}, rng, true);
    expect_grouped_tiles_match_rows(w, 20, 272, 1024, {0}, rng, true);
  }
}

// Grouped (MoE) gemv and its slot builder, against the same fp64 reference per routed pair.

struct GroupedCase {
  GemvWeight weight;
  GemvScale fp8_scale;
  int tokens, k_pick, experts, n, k;
  int x_row_div;       // k_pick: x rows are tokens (up projections); 1: x rows are pairs (down projection)
  bool one_expert;     // every pick goes to expert 3, twice per token: more rows than a tile -> several passes
  bool second = false; // a second projection in the same launch (w3 next to w1)
  GemvAct act = GemvAct::BF16;
  bool bulk = false;   // fp4 weights through the copy engine
  int tiled_min = 0;   // > 0: set_gemv_tiled_min_rows(tiled_min) (decode batches on the tiled kernel)
  int wgmma = 0;        // fp4 weights in 64-row tiles: as Case::wgmma
  int walk = 0;         // the warp-specialised shapes' blocks (WalkScope)
};

std::string grouped_name(const GroupedCase& c) {
  Case base{c.weight, c.fp8_scale, 1, c.n, c.k, GemvOut::F32, 0};
  std::string s = case_name(base);
  s = s.substr(0, s.find("_m1_")) + "_t" + std::to_string(c.tokens) + "x" + std::to_string(c.k_pick) + "_E" +
      std::to_string(c.experts) + "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k) +
      (c.x_row_div == 1 ? "_pairrows" : "_tokenrows") + (c.one_expert ? "_oneexpert" : "") +
      (c.second ? "_second" : "") + (c.act == GemvAct::FP8 ? "_actfp8" : "") + (c.bulk ? "_bulk" : "") +
      (c.tiled_min ? "_tiledfrom" + std::to_string(c.tiled_min) : "") +
      (c.wgmma ? c.wgmma == kMmaSync ? "_mmasync" : "_wgmma" + std::to_string(c.wgmma) : "") +
      (c.walk ? c.walk == kPerTile ? "_pertile" : "_walk" + std::to_string(c.walk) : "");
  return s;
}

class GemvGroupedTest : public ::testing::TestWithParam<GroupedCase> {};

TEST_P(GemvGroupedTest, MatchesFp64ReferencePerPair) {
  DSV4_REQUIRE_CUDA();
  const GroupedCase c = GetParam();
  const uint64_t seed = std::random_device{}() ^ std::hash<std::string>{}(grouped_name(c));
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int pairs = c.tokens * c.k_pick, x_rows = c.x_row_div == 1 ? pairs : c.tokens;
  const int projections = c.second ? 2 : 1;
  std::vector<HostProblem> expert;  // [projection · experts + e]
  for (int e = 0; e < projections * c.experts; ++e)
    expert.push_back(make_problem({c.weight, c.fp8_scale, 1, c.n, c.k, GemvOut::F32, 0}, rng));
  std::vector<uint16_t> x(size_t(x_rows) * c.k);
  std::uniform_real_distribution<float> val(-2.0f, 2.0f);
  for (auto& v : x) v = f32_to_bf16(val(rng));
  std::vector<int32_t> ids(pairs);
  for (int t = 0; t < c.tokens; ++t) {
    std::vector<int32_t> perm(c.experts);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < c.k_pick; ++i) ids[t * c.k_pick + i] = c.one_expert ? 3 : perm[i];
  }

  const size_t w_stride = size_t(gemv_weight_bytes(c.weight, c.n, c.k));
  const size_t s_stride = size_t(gemv_scale_bytes(c.weight, c.n, c.k, c.fp8_scale));
  const int E = c.experts;
  DeviceBuffer dx(x.size() * 2), dw(w_stride * E * projections), ds(std::max<size_t>(s_stride * E * projections, 16)),
      ds2(E * projections * 4), dids(pairs * 4), dy(size_t(pairs) * c.n * 4 * projections), count(4),
      slot_expert(E * 4), slot_offset((E + 1) * 4), order(pairs * 4), act_scratch(x.size() * 2);
  dx.upload(x.data(), x.size() * 2);
  std::vector<float> scale_2;
  for (int e = 0; e < projections * E; ++e) {
    ASSERT_EQ(expert[e].w.size(), w_stride);
    dw.upload(expert[e].w.data(), w_stride, e * w_stride);
    if (s_stride) ds.upload(expert[e].scale.data(), s_stride, e * s_stride);
    scale_2.push_back(expert[e].scale_2);
  }
  ds2.upload(scale_2.data(), scale_2.size() * 4);
  dids.upload(ids.data(), ids.size() * 4);
  dy.fill_bytes(0xff);

  MoeSlotsParams sp;
  sp.ids = dids.as<int32_t>(), sp.n = c.tokens, sp.k = c.k_pick, sp.experts = c.experts;
  sp.slots = {count.as<int32_t>(), slot_expert.as<int32_t>(), slot_offset.as<int32_t>(), order.as<int32_t>()};
  moe_slots(sp);
  GemvGroupedParams g;
  g.base.m = c.tokens, g.base.n = c.n, g.base.k = c.k;
  g.base.x = dx.data(), g.base.w = dw.data(), g.base.w_scale = s_stride ? ds.data() : nullptr;
  g.base.y = dy.data(), g.base.weight = c.weight, g.base.fp8_scale = c.fp8_scale;
  g.w_expert_stride = w_stride, g.scale_expert_stride = s_stride, g.scale_2 = ds2.as<float>();
  g.max_slots = std::min(c.experts, pairs);
  g.slots = sp.slots, g.x_row_div = c.x_row_div;
  g.base.act = c.act, g.base.act_scratch = act_scratch.data(), g.x_rows = x_rows;
  if (c.second) {  // the second projection's experts follow the first's in every buffer
    g.second.w = static_cast<const char*>(dw.data()) + w_stride * E;
    g.second.w_scale = s_stride ? static_cast<const char*>(ds.data()) + s_stride * E : nullptr;
    g.second.scale_2 = ds2.as<float>() + E;
    g.second.y = dy.as<float>() + size_t(pairs) * c.n;
  }
  const BulkScope bulk(c.bulk);
  if (c.bulk) {
    ASSERT_TRUE(detail::gemv_bulk_grouped_supported(g) || detail::gemv_w4a8_bulk_supported(g.base))
        << "the case must run a copy-engine kernel";
  }
  const TiledMinScope tiled_min(c.tiled_min);
  if (c.tiled_min) ASSERT_TRUE(detail::gemv_tiled_supported(g.base)) << "the case must run the tiled kernel";
  const KernelScope kernel(c.wgmma);
  const WalkScope walkers(c.walk);
  gemv_grouped(g);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  // Slots: experts ascending, offsets the running counts, pairs of a slot in ascending order.
  int32_t n_slots = 0;
  count.download(&n_slots, 4);
  std::vector<int32_t> se(c.experts), so(c.experts + 1), ro(pairs);
  slot_expert.download(se.data(), se.size() * 4);
  slot_offset.download(so.data(), so.size() * 4);
  order.download(ro.data(), ro.size() * 4);
  std::vector<int> per_expert(c.experts, 0);
  for (int32_t id : ids) ++per_expert[id];
  int want_slots = 0;
  for (int e = 0; e < c.experts; ++e) want_slots += per_expert[e] > 0;
  ASSERT_EQ(n_slots, want_slots);
  EXPECT_EQ(so[0], 0);
  EXPECT_EQ(so[n_slots], pairs);
  for (int s = 0; s < n_slots; ++s) {
    if (s) {
      EXPECT_LT(se[s - 1], se[s]);
    }
    EXPECT_EQ(so[s + 1] - so[s], per_expert[se[s]]);
    for (int r = so[s]; r < so[s + 1]; ++r) {
      EXPECT_EQ(ids[ro[r]], se[s]);
      if (r > so[s]) {
        EXPECT_LT(ro[r - 1], ro[r]);
      }
    }
  }

  std::vector<float> got(size_t(pairs) * c.n * projections);
  dy.download(got.data(), got.size() * 4);
  if (c.second) {
    // GemvGroupedParams::swiglu: the same launch again with the SwiGLU (inside the register kernel's last block of
    // each slot, in the wgmma kernel's paired w1 + w3 tiles, else a launch after) must give gpu::swiglu's bits on
    // these outputs and leave the tickets at 0; the paired tiles (the warp-specialised shapes) write no fp32 output,
    // every other kernel the same as without the SwiGLU.
    std::vector<float> weights(pairs);
    for (float& v : weights) v = val(rng);
    DeviceBuffer dweights(weights.size() * 4), h_fused(size_t(pairs) * c.n * 2), h_alone(size_t(pairs) * c.n * 2),
        tickets(size_t(g.max_slots) * 4);
    dweights.upload(weights.data(), weights.size() * 4);
    tickets.fill_bytes(0);
    gpu::SwigluParams sw;
    sw.gate = dy.as<float>(), sw.up = dy.as<float>() + size_t(pairs) * c.n, sw.ld = c.n;
    sw.weights = dweights.as<float>(), sw.rows = pairs, sw.inter = c.n, sw.limit = 1.5f;
    sw.h = h_alone.as<uint16_t>();
    gpu::swiglu(sw, nullptr);
    GemvGroupedParams gs = g;
    gs.swiglu = sw;
    gs.swiglu.h = h_fused.as<uint16_t>();
    gs.slot_tickets = tickets.as<uint32_t>();
    dy.fill_bytes(0xff);
    h_fused.fill_bytes(0xff);
    const int kernels = gemv_grouped(gs);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    const bool paired = c.wgmma == 4 || c.wgmma == 5;
    const bool in_register_kernel = detail::grouped_kernel(gs) == detail::GroupedKernel::Register;
    EXPECT_EQ(kernels, paired || in_register_kernel ? 1 : 2);
    std::vector<float> again(got.size());
    dy.download(again.data(), again.size() * 4);
    if (paired) {
      const std::vector<uint8_t> untouched(again.size() * 4, 0xff);
      EXPECT_EQ(0, std::memcmp(again.data(), untouched.data(), untouched.size())) << "the paired tiles wrote y";
    } else {
      EXPECT_EQ(0, std::memcmp(again.data(), got.data(), got.size() * 4)) << "outputs changed with the swiglu";
    }
    std::vector<uint16_t> fused(size_t(pairs) * c.n), alone(fused.size());
    h_fused.download(fused.data(), fused.size() * 2);
    h_alone.download(alone.data(), alone.size() * 2);
    EXPECT_EQ(fused, alone) << "the grouped launch's swiglu differs from gpu::swiglu (" << kernels << " kernels)";
    std::vector<uint32_t> left(g.max_slots);
    tickets.download(left.data(), left.size() * 4);
    EXPECT_EQ(std::count(left.begin(), left.end(), 0u), std::ptrdiff_t(left.size())) << "tickets not left at 0";
  }
  const std::vector<double> xq = effective_x(x, x_rows, c.k, c.act);
  const double acc_bound = acc_bound_for(g.base);
  int bad = 0, unwritten = 0;
  double worst_ratio = 0;
  for (int row = 0; row < pairs * projections; ++row) {
    const int pr = row % pairs, proj = row / pairs;
    const HostProblem& h = expert[proj * E + ids[pr]];
    const double* xr = &xq[size_t(pr / c.x_row_div) * c.k];
    for (int ni = 0; ni < c.n; ++ni) {
      double ref = 0, absum = 0;
      for (int ki = 0; ki < c.k; ++ki) {
        const double t = xr[ki] * h.w_deq[size_t(ni) * c.k + ki];
        ref += t;
        absum += std::fabs(t);
      }
      const float v = got[size_t(row) * c.n + ni];
      if (!std::isfinite(v)) {
        ++unwritten;
        continue;
      }
      const double err = std::fabs(double(v) - ref), allowed = acc_bound * absum;
      worst_ratio = std::max(worst_ratio, err / allowed);
      if (err > allowed && ++bad <= 5)
        ADD_FAILURE() << "projection " << proj << " pair " << pr << " (expert " << ids[pr] << ") y[" << ni
                      << "] = " << v << ", reference " << ref;
    }
  }
  EXPECT_EQ(unwritten, 0);
  EXPECT_EQ(bad, 0);
  std::printf("[gemv-grouped] %-64s slots %d  worst err/allowed %.3f\n", grouped_name(c).c_str(), n_slots,
              worst_ratio);
}

std::vector<GroupedCase> grouped_cases() {
  std::vector<GroupedCase> cases;
  const std::pair<GemvWeight, GemvScale> formats[] = {{GemvWeight::BF16, GemvScale::E8M0},
                                                      {GemvWeight::FP8_BLOCK, GemvScale::E8M0},
                                                      {GemvWeight::FP8_BLOCK, GemvScale::F32},
                                                      {GemvWeight::MXFP4, GemvScale::E8M0},
                                                      {GemvWeight::NVFP4, GemvScale::E8M0}};
  for (const auto& [w, s] : formats) {
    cases.push_back({w, s, 1, 6, 16, 200, 1056, 6, false});    // decode: 6 slots of one row
    cases.push_back({w, s, 5, 6, 16, 200, 1056, 1, false});    // down projection: x rows are pairs
    cases.push_back({w, s, 64, 6, 16, 136, 512, 6, false});    // a prefill chunk: up to 64 rows per slot
    cases.push_back({w, s, 40, 2, 8, 72, 256, 2, true});       // 80 rows on one expert: two passes over W
    cases.push_back({w, s, 1, 6, 16, 200, 1056, 6, false, true});   // w1 + w3 of a decode step
    cases.push_back({w, s, 64, 6, 16, 136, 512, 6, false, true});   // w1 + w3 of a prefill chunk
    // base.m > 64: the tiled kernel (slots of ~56 and of 0..150 rows; 200 rows on one expert: a second pass)
    cases.push_back({w, s, 150, 6, 16, 136, 512, 6, false, true});
    cases.push_back({w, s, 150, 6, 16, 136, 512, 1, false});
    cases.push_back({w, s, 100, 2, 8, 72, 256, 2, true});
    if (w == GemvWeight::MXFP4 || w == GemvWeight::NVFP4)  // the three above on wgmma (too small to be chosen)
      for (int shape : {3, 1, 4, 5}) {
        const GemvAct a = GemvAct::BF16;
        cases.push_back({w, s, 150, 6, 16, 136, 512, 6, false, true, a, false, 0, shape});
        cases.push_back({w, s, 150, 6, 16, 136, 512, 1, false, false, a, false, 0, shape});
        cases.push_back({w, s, 100, 2, 8, 72, 256, 2, true, false, a, false, 0, shape});
        cases.push_back({w, s, 48, 6, 16, 136, 512, 6, false, true, a, false, 2, shape});  // 33..64 rows a slot
      }
    // The warp-specialised ones with each block walking the tiles of several slots (and their empty token blocks),
    // and with one block per tile.
    if (w == GemvWeight::MXFP4 || w == GemvWeight::NVFP4)
      for (int shape : {4, 5})
        for (int walk : {1, 3, kPerTile}) {
          const GemvAct a = GemvAct::BF16;
          cases.push_back({w, s, 150, 6, 16, 136, 512, 6, false, true, a, false, 0, shape, walk});
          cases.push_back({w, s, 150, 6, 16, 136, 512, 1, false, false, a, false, 0, shape, walk});
          cases.push_back({w, s, 100, 2, 8, 72, 256, 2, true, false, a, false, 0, shape, walk});
        }
    // Decode batches on the tiled kernel (set_gemv_tiled_min_rows): slots of a few rows in 16- / 32-row tiles,
    // 40 rows on one expert in 32-row tiles (a second pass)
    if (s == GemvScale::E8M0) {
      const GemvAct a = GemvAct::BF16;
      cases.push_back({w, s, 8, 6, 16, 200, 1056, 6, false, true, a, false, 2});
      cases.push_back({w, s, 32, 6, 16, 136, 512, 6, false, true, a, false, 2});
      cases.push_back({w, s, 32, 6, 16, 200, 1056, 1, false, false, a, false, 2});
      cases.push_back({w, s, 20, 2, 8, 72, 256, 2, true, false, a, false, 2});
    }
    // act FP8: decode slots (W4A8 for fp4 weights), a slot holding two rows, and quantised x rows (m > 1)
    cases.push_back({w, s, 1, 6, 16, 200, 1056, 6, false, true, GemvAct::FP8});
    cases.push_back({w, s, 1, 6, 16, 200, 1056, 1, false, false, GemvAct::FP8});
    cases.push_back({w, s, 1, 2, 8, 72, 256, 2, true, false, GemvAct::FP8});
    cases.push_back({w, s, 5, 6, 16, 200, 1056, 1, false, false, GemvAct::FP8});
    cases.push_back({w, s, 100, 6, 16, 136, 512, 6, false, true, GemvAct::FP8});
    if (w != GemvWeight::BF16) {  // the copy-engine kernel: k a multiple of 512 (fp4) / 256 (fp8)
      const GemvAct a = GemvAct::BF16;
      cases.push_back({w, s, 1, 6, 16, 200, 1024, 6, false, false, a, true});
      cases.push_back({w, s, 5, 6, 16, 200, 1024, 1, false, false, a, true});
      cases.push_back({w, s, 64, 6, 16, 136, 512, 6, false, false, a, true});
      cases.push_back({w, s, 40, 2, 8, 72, 512, 2, true, false, a, true});  // 80 rows on one expert: two passes
      cases.push_back({w, s, 1, 6, 16, 200, 1024, 6, false, true, a, true});
      cases.push_back({w, s, 5, 6, 16, 200, 1024, 1, false, false, GemvAct::FP8, true});
      if (w != GemvWeight::FP8_BLOCK) {  // decode slots through the W4A8 kernel's copy-engine variant
        cases.push_back({w, s, 1, 6, 16, 200, 1024, 6, false, true, GemvAct::FP8, true});
        cases.push_back({w, s, 1, 6, 16, 200, 1024, 1, false, false, GemvAct::FP8, true});
        cases.push_back({w, s, 1, 2, 8, 72, 512, 2, true, false, GemvAct::FP8, true});  // a slot with two rows
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllFormats, GemvGroupedTest, ::testing::ValuesIn(grouped_cases()),
                         [](const ::testing::TestParamInfo<GroupedCase>& info) { return grouped_name(info.param); });

// Row ranges and output strides (a fused projection's parts, the grouped output projection's groups): rows
// [row0, row0 + rows) of a matrix written into columns of a wider y; the columns outside stay poisoned.
TEST(GemvRows, RowRangeIntoStridedOutput) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(7);
  for (const auto& [w, s] : {std::pair{GemvWeight::BF16, GemvScale::E8M0}, {GemvWeight::FP8_BLOCK, GemvScale::E8M0},
                             {GemvWeight::MXFP4, GemvScale::E8M0}, {GemvWeight::NVFP4, GemvScale::E8M0}}) {
    const int m = 3, n_full = 300, k = 1056, row0 = 144, rows = 100, ldy = 130;
    const HostProblem h = make_problem({w, s, m, n_full, k, GemvOut::F32, 0}, rng);
    DeviceBuffer x(h.x.size() * 2), dw(h.w.size()), ds(std::max<size_t>(h.scale.size(), 16)), y(size_t(m) * ldy * 4);
    x.upload(h.x.data(), h.x.size() * 2);
    dw.upload(h.w.data(), h.w.size());
    if (!h.scale.empty()) ds.upload(h.scale.data(), h.scale.size());
    y.fill_bytes(0xff);
    GemvParams p;
    p.m = m, p.n = rows, p.k = k, p.x = x.data(), p.w = dw.data(), p.w_scale = ds.data();
    p.w_row0 = row0, p.w_scale_2 = h.scale_2, p.ldy = ldy, p.y = y.as<float>() + 20;
    p.weight = w, p.fp8_scale = s;
    gemv(p);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got(size_t(m) * ldy);
    y.download(got.data(), got.size() * 4);
    for (int mi = 0; mi < m; ++mi)
      for (int col = 0; col < ldy; ++col) {
        const float v = got[size_t(mi) * ldy + col];
        if (col < 20 || col >= 20 + rows) {
          EXPECT_TRUE(std::isnan(v)) << gemv_weight_name(w) << ": column " << col << " outside the range was written";
          continue;
        }
        const int r = row0 + col - 20;
        double ref = 0, absum = 0;
        for (int ki = 0; ki < k; ++ki) {
          const double t = double(bf16_to_f32(h.x[size_t(mi) * k + ki])) * h.w_deq[size_t(r) * k + ki];
          ref += t;
          absum += std::fabs(t);
        }
        EXPECT_LE(std::fabs(double(v) - ref), 1e-5 * absum) << gemv_weight_name(w) << " row " << r;
      }
  }
}

// moe_slots' placement form for a test's scope (set_moe_slots_by_warps), restored after.
struct SlotsForm {
  const bool built = moe_slots_by_warps();
  explicit SlotsForm(bool by_warps) { set_moe_slots_by_warps(by_warps); }
  ~SlotsForm() { set_moe_slots_by_warps(built); }
};

// The shared expert as one more grouped expert: pair t·(k+1) + k of every token goes to it with weight 1, the
// picks keep their order and weights. Both placement forms.
class MoeSlotsForms : public ::testing::TestWithParam<bool> {};

TEST_P(MoeSlotsForms, SharedExpertPairs) {
  DSV4_REQUIRE_CUDA();
  const bool by_warps = GetParam();
  const int n = 5, k = 6, routed = 16, shared = routed, per_token = k + 1, pairs = n * per_token;
  std::mt19937_64 rng(3);
  std::vector<int32_t> ids(n * k);
  std::vector<float> weights(n * k);
  for (int t = 0; t < n; ++t) {
    std::vector<int32_t> perm(routed);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < k; ++i) ids[t * k + i] = perm[i], weights[t * k + i] = 0.1f * float(t * k + i + 1);
  }
  DeviceBuffer dids(ids.size() * 4), dw(weights.size() * 4), dpw(pairs * 4), count(4), se((routed + 1) * 4),
      so((routed + 2) * 4), order(pairs * 4);
  dids.upload(ids.data(), ids.size() * 4);
  dw.upload(weights.data(), weights.size() * 4);
  dpw.fill_bytes(0xff);
  MoeSlotsParams sp;
  sp.ids = dids.as<int32_t>(), sp.n = n, sp.k = k, sp.experts = routed + 1, sp.shared_expert = shared;
  sp.weights = dw.as<float>(), sp.pair_weights = dpw.as<float>();
  sp.slots = {count.as<int32_t>(), se.as<int32_t>(), so.as<int32_t>(), order.as<int32_t>()};
  const SlotsForm form(by_warps);
  moe_slots(sp);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  int32_t n_slots = 0;
  count.download(&n_slots, 4);
  std::vector<int32_t> h_se(routed + 1), h_so(routed + 2), h_order(pairs);
  std::vector<float> h_pw(pairs);
  se.download(h_se.data(), h_se.size() * 4);
  so.download(h_so.data(), h_so.size() * 4);
  order.download(h_order.data(), h_order.size() * 4);
  dpw.download(h_pw.data(), h_pw.size() * 4);
  ASSERT_GE(n_slots, 2);
  EXPECT_EQ(h_se[n_slots - 1], shared) << "the shared expert is the last (highest) slot";
  EXPECT_EQ(h_so[n_slots] - h_so[n_slots - 1], n) << "one shared pair per token";
  for (int r = h_so[n_slots - 1]; r < h_so[n_slots]; ++r) EXPECT_EQ(h_order[r] % per_token, k);
  EXPECT_EQ(h_so[n_slots], pairs);
  for (int s = 0; s + 1 < n_slots; ++s)
    for (int r = h_so[s]; r < h_so[s + 1]; ++r) {
      const int pair = h_order[r], t = pair / per_token, i = pair % per_token;
      ASSERT_LT(i, k);
      EXPECT_EQ(ids[t * k + i], h_se[s]);
    }
  for (int s = 0; s < n_slots; ++s)  // each slot's pairs in ascending order (a stable sort)
    for (int r = h_so[s] + 1; r < h_so[s + 1]; ++r) EXPECT_LT(h_order[r - 1], h_order[r]) << "slot " << s;
  for (int t = 0; t < n; ++t)
    for (int i = 0; i <= k; ++i)
      EXPECT_EQ(h_pw[t * per_token + i], i == k ? 1.0f : weights[t * k + i]) << "token " << t << " pair " << i;
}

// moe_slots against a host counting sort: prefill-sized chunks (several warps' worth of tokens per expert), tokens
// that repeat an expert among their picks, experts with no pair, with and without the shared expert, fewer pairs
// than warps, more experts than the per-warp counts take (1000: the one-warp placement in either form), and chunks
// of 4096 tokens (28672 pairs) and 3640 x 9 = 32760 pairs, just under kMoeSlotsMaxPairs.
TEST_P(MoeSlotsForms, MatchesHostCountingSort) {
  DSV4_REQUIRE_CUDA();
  const SlotsForm form(GetParam());
  std::mt19937_64 rng(17);
  for (const auto& [n, k, routed, shared] :
       {std::tuple{512, 6, 32, true}, {576, 6, 256, true}, {100, 8, 5, false}, {1, 6, 16, true}, {70, 2, 3, false},
        {4, 3, 7, false}, {300, 6, 1000, false}, {585, 6, 384, true}, {4096, 6, 256, true}, {3640, 8, 64, true}}) {
    const int experts = routed + (shared ? 1 : 0), per_token = k + (shared ? 1 : 0), pairs = n * per_token;
    std::vector<int32_t> ids(size_t(n) * k);
    std::uniform_int_distribution<int> pick(0, routed - 1);
    for (int32_t& id : ids) id = pick(rng);  // repeats within a token allowed
    std::vector<float> weights(ids.size(), 0.5f);
    DeviceBuffer dids(ids.size() * 4), dw(weights.size() * 4), dpw(size_t(pairs) * 4), count(4),
        se(size_t(experts) * 4), so(size_t(experts + 1) * 4), order(size_t(pairs) * 4);
    dids.upload(ids.data(), ids.size() * 4);
    dw.upload(weights.data(), weights.size() * 4);
    MoeSlotsParams sp;
    sp.ids = dids.as<int32_t>(), sp.n = n, sp.k = k, sp.experts = experts, sp.shared_expert = shared ? routed : -1;
    sp.weights = dw.as<float>(), sp.pair_weights = dpw.as<float>();
    sp.slots = {count.as<int32_t>(), se.as<int32_t>(), so.as<int32_t>(), order.as<int32_t>()};
    moe_slots(sp);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    // Host: experts ascending, each expert's pairs in ascending pair order.
    std::vector<std::vector<int32_t>> by_expert(static_cast<size_t>(experts));
    for (int i = 0; i < pairs; ++i) {
      const int t = i / per_token, j = i % per_token;
      by_expert[size_t(j == k ? routed : ids[size_t(t) * k + j])].push_back(i);
    }
    std::vector<int32_t> want_expert, want_offset{0}, want_order;
    for (int e = 0; e < experts; ++e)
      if (!by_expert[size_t(e)].empty()) {
        want_expert.push_back(e);
        want_order.insert(want_order.end(), by_expert[size_t(e)].begin(), by_expert[size_t(e)].end());
        want_offset.push_back(int32_t(want_order.size()));
      }
    int32_t n_slots = 0;
    count.download(&n_slots, 4);
    ASSERT_EQ(n_slots, int32_t(want_expert.size())) << "n " << n << " experts " << experts;
    std::vector<int32_t> got_expert(static_cast<size_t>(n_slots)), got_offset(static_cast<size_t>(n_slots) + 1),
        got_order(static_cast<size_t>(pairs));
    se.download(got_expert.data(), got_expert.size() * 4);
    so.download(got_offset.data(), got_offset.size() * 4);
    order.download(got_order.data(), got_order.size() * 4);
    EXPECT_EQ(got_expert, want_expert) << "n " << n << " experts " << experts;
    EXPECT_EQ(got_offset, want_offset) << "n " << n << " experts " << experts;
    EXPECT_EQ(got_order, want_order) << "n " << n << " experts " << experts;
  }
}

INSTANTIATE_TEST_SUITE_P(MoeSlots, MoeSlotsForms, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "ByWarps" : "OneWarp"; });

// Batched launches (the grouped output projection): batch b multiplies its own x rows by the next n rows of the
// matrix and writes its own columns of a token-major y [m, batch · n]; the padding column stays poisoned.
TEST(GemvBatched, GroupsIntoTokenMajorOutput) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(11);
  for (const auto& [w, s] : {std::pair{GemvWeight::BF16, GemvScale::E8M0}, {GemvWeight::FP8_BLOCK, GemvScale::E8M0},
                             {GemvWeight::FP8_BLOCK, GemvScale::F32}, {GemvWeight::MXFP4, GemvScale::E8M0},
                             {GemvWeight::NVFP4, GemvScale::E8M0}})
    for (int m : {1, 3, 64, 100}) {  // 100: the tiled kernel
      const int batch = 8, n = 48, k = 1056, ldy = batch * n + 1;
      const HostProblem h = make_problem({w, s, m * batch, batch * n, k, GemvOut::F32, 0}, rng);  // x [batch, m, k]
      DeviceBuffer x(h.x.size() * 2), dw(h.w.size()), ds(std::max<size_t>(h.scale.size(), 16)),
          y(size_t(m) * ldy * 4);
      x.upload(h.x.data(), h.x.size() * 2);
      dw.upload(h.w.data(), h.w.size());
      if (!h.scale.empty()) ds.upload(h.scale.data(), h.scale.size());
      // fp4 at m = 100 also on each wgmma block shape (the grid is too small for the engine to choose one; the
      // prefill's grouped output projection wo_a runs batched on the warp-specialised one).
      const bool fp4 = w == GemvWeight::MXFP4 || w == GemvWeight::NVFP4;
      // The warp-specialised ones also with each block walking several tiles (batches) and with one block per tile.
      std::vector<std::pair<int, int>> kernels{{0, 0}};
      if (fp4 && m == 100)
        for (int kernel : {1, 3, 4, 5})
          for (int walk : kernel >= 4 ? std::vector<int>{0, 1, 3, kPerTile} : std::vector<int>{0})
            kernels.push_back({kernel, walk});
      for (const auto& [kernel, walk] : kernels) {
        const KernelScope scope(kernel);
        const WalkScope walkers(walk);
        y.fill_bytes(0xff);
        GemvBatchedParams b;
        b.base.m = m, b.base.n = n, b.base.k = k, b.base.x = x.data(), b.base.w = dw.data();
        b.base.w_scale = ds.data(), b.base.w_scale_2 = h.scale_2, b.base.ldy = ldy, b.base.y = y.data();
        b.base.weight = w, b.base.fp8_scale = s;
        b.batch = batch, b.x_batch_stride = int64_t(m) * k, b.y_batch_stride = n;
        gemv_batched(b);
        DSV4_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got(size_t(m) * ldy);
        y.download(got.data(), got.size() * 4);
        int bad = 0;
        for (int mi = 0; mi < m; ++mi) {
          EXPECT_TRUE(std::isnan(got[size_t(mi) * ldy + ldy - 1])) << "padding column written";
          for (int col = 0; col < batch * n; ++col) {
            const int g = col / n, r = col;  // batch g, weight row g·n + (col % n) = col
            double ref = 0, absum = 0;
            for (int ki = 0; ki < k; ++ki) {
              const double t = double(bf16_to_f32(h.x[(size_t(g) * m + mi) * k + ki])) * h.w_deq[size_t(r) * k + ki];
              ref += t;
              absum += std::fabs(t);
            }
            const float v = got[size_t(mi) * ldy + col];
            if (!(std::fabs(double(v) - ref) <= 1e-5 * absum) && ++bad <= 5)
              ADD_FAILURE() << gemv_weight_name(w) << " m " << m << " kernel " << kernel << " walk " << walk << " y["
                            << mi << ", " << col
                            << "] = " << v << ", reference " << ref;
          }
        }
        EXPECT_EQ(bad, 0) << gemv_weight_name(w) << " m " << m << " kernel " << kernel << " walk " << walk;
      }
    }
}

// ---------------------------------------------------------------------------------------------------------
// Argument checks (no GPU needed: they throw before any CUDA call).

GemvParams fake_params(GemvWeight w, int m, int n, int k) {
  alignas(16) static char dummy[16];
  GemvParams p;
  p.m = m, p.n = n, p.k = k, p.weight = w;
  p.x = dummy, p.w = dummy, p.w_scale = dummy, p.y = dummy;
  return p;
}

// act_quant_fp8 against fp8_simulate_block, bit for bit: rows of mixed magnitudes (a zero block, a block whose
// amax sits on a power of two times 448, saturating and subnormal e4m3 codes), in place and out of place.
TEST(ActQuant, MatchesFp8SimulateBlock) {
  DSV4_REQUIRE_CUDA();
  const int rows = 5, k = 1056;  // the last block of each row is partial (32 elements)
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> x(size_t(rows) * k);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < k; ++i) {
      const int block = i / 128;
      const float mag = std::ldexp(1.0f, (r * 7 + block * 5) % 40 - 24);
      x[size_t(r) * k + i] = f32_to_bf16(block == 3 && r == 1 ? 0.0f : u(rng) * mag);
    }
  x[2 * k + 5] = f32_to_bf16(448.0f * 4.0f);  // amax = 448 * 2^2 exactly
  std::vector<uint16_t> want(x.size());
  for (int r = 0; r < rows; ++r) {
    std::vector<float> f(k);
    for (int i = 0; i < k; ++i) f[i] = bf16_to_f32(x[size_t(r) * k + i]);
    for (int b = 0; b < k; b += 128) fp8_simulate_block(&f[b], std::min(128, k - b));
    for (int i = 0; i < k; ++i) want[size_t(r) * k + i] = f32_to_bf16(f[i]);
  }
  DeviceBuffer dx(x.size() * 2), dy(x.size() * 2);
  dx.upload(x.data(), x.size() * 2);
  dy.fill_bytes(0xff);
  act_quant_fp8(dx.data(), dy.data(), rows, k, nullptr);
  act_quant_fp8(dx.data(), dx.data(), rows, k, nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  for (DeviceBuffer* out : {&dy, &dx}) {
    std::vector<uint16_t> got(x.size());
    out->download(got.data(), got.size() * 2);
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i] && ++bad <= 5)
        ADD_FAILURE() << (out == &dx ? "in place" : "out of place") << " element " << i << ": got "
                      << bf16_to_f32(got[i]) << ", want " << bf16_to_f32(want[i]);
    EXPECT_EQ(bad, 0);
  }
}

// The test-only split override takes 0 (the heuristic) or a power of two up to the warps of a block; the copy-engine
// mode 'dense' leaves the grouped launches on the register kernel (no GPU needed: the choice is host arithmetic).
TEST(GemvArgs, ForcedSplitAndBulkModes) {
  for (const int bad : {-1, 3, 6, 16, 1 << 20}) EXPECT_THROW(set_gemv_forced_split(bad), Error) << bad;
  for (const int good : {1, 2, 4, 8, 0}) EXPECT_NO_THROW(set_gemv_forced_split(good)) << good;
  const GemvBulk before = gemv_bulk_mode();
  GemvGroupedParams g;
  g.base = fake_params(GemvWeight::NVFP4, 1, 2048, 4096);
  g.w_expert_stride = g.scale_expert_stride = 4096;
  set_gemv_bulk(GemvBulk::Dense);
  EXPECT_TRUE(gemv_bulk_enabled());
  EXPECT_TRUE(detail::gemv_bulk_supported(g.base));
  EXPECT_FALSE(detail::gemv_bulk_grouped_supported(g));
  set_gemv_bulk(GemvBulk::All);
  EXPECT_TRUE(detail::gemv_bulk_grouped_supported(g));
  set_gemv_bulk(GemvBulk::Off);
  EXPECT_FALSE(detail::gemv_bulk_supported(g.base));
  set_gemv_bulk(before);
}

TEST(GemvArgs, RejectsBadShapesAndPointers) {
  EXPECT_THROW(gemv(fake_params(GemvWeight::BF16, kGemvMaxRows + 1, 16, 64)), Error);  // m too large
  EXPECT_THROW(gemv(fake_params(GemvWeight::BF16, -1, 16, 64)), Error);
  EXPECT_THROW(gemv(fake_params(GemvWeight::BF16, 1, 16, 0)), Error);     // k == 0
  EXPECT_THROW(gemv(fake_params(GemvWeight::BF16, 1, 16, 12)), Error);    // k % 8
  EXPECT_THROW(gemv(fake_params(GemvWeight::FP8_BLOCK, 1, 16, 24)), Error);  // k % 16
  EXPECT_THROW(gemv(fake_params(GemvWeight::MXFP4, 1, 16, 48)), Error);   // k % 32
  EXPECT_THROW(gemv(fake_params(GemvWeight::NVFP4, 1, 16, 16)), Error);   // k % 32
  GemvParams p = fake_params(GemvWeight::MXFP4, 1, 16, 64);
  p.w_scale = nullptr;
  EXPECT_THROW(gemv(p), Error);
  p = fake_params(GemvWeight::BF16, 1, 16, 64);
  p.split_k = 3;
  EXPECT_THROW(gemv(p), Error);
  p = fake_params(GemvWeight::BF16, 1, 16, 64);
  p.x = static_cast<const char*>(p.x) + 2;  // misaligned
  EXPECT_THROW(gemv(p), Error);
  try {
    gemv(fake_params(GemvWeight::MXFP4, 1, 16, 48));
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mxfp4"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(gemv(fake_params(GemvWeight::BF16, 0, 16, 64)));  // empty problem: no launch
  p = fake_params(GemvWeight::BF16, 3, 16, 64);
  p.act = GemvAct::FP8;  // needs act_scratch outside the W4A8 kernel
  EXPECT_THROW(gemv(p), Error);
  p = fake_params(GemvWeight::NVFP4, 1, 16, 64);
  p.act = GemvAct::FP8;
  {
    const W4a8Scope w4a8(true);
    EXPECT_TRUE(gemv_uses_w4a8(p));
    p.m = 2;
    EXPECT_FALSE(gemv_uses_w4a8(p));
    p.m = 1;
  }
  const W4a8Scope w4a8(false);
  EXPECT_FALSE(gemv_uses_w4a8(p));
}

// The uploader's permutation on the device is weight_tiles::from_rows, and the prefill GEMM's weight decode reads
// the tile layout as the rows it came from.
TEST(GemvTiles, DevicePermutationAndDequantMatchRows) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(5);
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4}) {
    const int n = 96, k = 1152;
    const HostProblem h = make_problem({w, GemvScale::E8M0, 1, n, k, GemvOut::F32, 0}, rng);
    const TiledCopy t = to_tiles(h, w, n, k);
    DeviceBuffer dw(h.w.size()), ds(h.scale.size()), scratch(h.w.size()), out_rows(size_t(n) * k * 2),
        out_tiles(size_t(n) * k * 2);
    dw.upload(h.w.data(), h.w.size());
    ds.upload(h.scale.data(), h.scale.size());
    WeightDesc d;
    d.n = n, d.k = k, d.weight = w, d.w = dw.data(), d.w_scale = ds.data();
    dequantize_weight_bf16(d, out_rows.as<uint16_t>(), nullptr);
    const size_t piece = w == GemvWeight::NVFP4 ? 2 : 1;
    gpu::rows_to_tiles(dw.data(), scratch.data(), size_t(n), size_t(k) / 2, 16, nullptr);
    gpu::rows_to_tiles(ds.data(), scratch.data(), size_t(n), size_t(k) / 32 * piece, piece, nullptr);
    std::vector<uint8_t> got_w(h.w.size()), got_s(h.scale.size());
    dw.download(got_w.data(), got_w.size());
    ds.download(got_s.data(), got_s.size());
    EXPECT_TRUE(got_w == t.w) << gemv_weight_name(w) << " weights";
    EXPECT_TRUE(got_s == t.scale) << gemv_weight_name(w) << " scales";
    d.layout = GemvLayout::Tiles;
    dequantize_weight_bf16(d, out_tiles.as<uint16_t>(), nullptr);
    DSV4_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> a(size_t(n) * k), b(size_t(n) * k);
    out_rows.download(a.data(), a.size() * 2);
    out_tiles.download(b.data(), b.size() * 2);
    EXPECT_TRUE(a == b) << gemv_weight_name(w) << " dequantised";
  }
  EXPECT_THROW(gpu::rows_to_tiles(nullptr, nullptr, 24, 64, 16, nullptr), Error);  // 24 rows: no whole tiles
}

TEST(GemvArgs, TileLayoutNeedsFp4AndWholeTiles) {
  auto tiled = [](GemvWeight w, int m, int n, int k) {
    GemvParams p = fake_params(w, m, n, k);
    p.layout = GemvLayout::Tiles;
    return p;
  };
  EXPECT_THROW(gemv(tiled(GemvWeight::BF16, 1, 16, 128)), Error);
  EXPECT_THROW(gemv(tiled(GemvWeight::FP8_BLOCK, 1, 16, 128)), Error);
  EXPECT_THROW(gemv(tiled(GemvWeight::NVFP4, 1, 24, 128)), Error);   // n % 16
  EXPECT_THROW(gemv(tiled(GemvWeight::NVFP4, 1, 16, 96)), Error);    // k % 128
  GemvParams p = tiled(GemvWeight::NVFP4, 1, 16, 128);
  p.w_row0 = 8;
  try {
    gemv(p);
    ADD_FAILURE() << "w_row0 8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tile layout"), std::string::npos) << e.what();
  }
}

// Act FP8 at m = 1 without the W4A8 kernel (x quantised into act_scratch, then the bf16-activation kernel) computes
// the same products as the W4A8 kernel: the two agree to fp32 summation order, 2^-13 of sum |x w| as the W4A8 bound.
TEST(GemvW4a8, QuantisedXThroughTheBf16KernelMatchesTheW4a8Kernel) {
  DSV4_REQUIRE_CUDA();
  std::mt19937_64 rng(44);
  for (const GemvWeight w : {GemvWeight::MXFP4, GemvWeight::NVFP4})
    for (const auto& [n, k] : {std::pair{301, 2048}, {45, 4096}, {64, 512}}) {
      const Case c{w, GemvScale::E8M0, 1, n, k, GemvOut::F32, 0, GemvAct::FP8};
      const HostProblem h = make_problem(c, rng);
      DeviceBuffer x(h.x.size() * 2), dw(h.w.size()), ds(h.scale.size()), y(size_t(n) * 4), scratch(h.x.size() * 2);
      x.upload(h.x.data(), h.x.size() * 2);
      dw.upload(h.w.data(), h.w.size());
      ds.upload(h.scale.data(), h.scale.size());
      GemvParams p;
      p.m = 1, p.n = n, p.k = k, p.x = x.data(), p.w = dw.data(), p.w_scale = ds.data(), p.w_scale_2 = h.scale_2;
      p.y = y.data(), p.weight = w, p.act = GemvAct::FP8, p.act_scratch = scratch.data();
      std::vector<std::vector<float>> got;
      for (const bool on : {true, false}) {
        const W4a8Scope w4a8(on);
        ASSERT_EQ(gemv_uses_w4a8(p), on);
        y.fill_bytes(0xff);
        gemv(p);
        DSV4_CUDA_CHECK(cudaDeviceSynchronize());
        got.emplace_back(size_t(n));
        y.download(got.back().data(), got.back().size() * 4);
      }
      const std::vector<double> xq = effective_x(h.x, 1, k, GemvAct::FP8);
      for (int r = 0; r < n; ++r) {
        double sum_abs = 0.0;
        for (int i = 0; i < k; ++i) sum_abs += std::abs(xq[size_t(i)] * h.w_deq[size_t(r) * k + i]);
        ASSERT_TRUE(std::isfinite(got[1][size_t(r)])) << "row " << r;
        EXPECT_LE(std::abs(double(got[0][size_t(r)]) - got[1][size_t(r)]), 0x1p-13 * sum_abs)
            << gemv_weight_name(w) << " n " << n << " k " << k << " row " << r;
      }
    }
}

TEST(GemvArgs, SplitHeuristic) {
  GemvParams p = fake_params(GemvWeight::FP8_BLOCK, 1, 4096, 8192);
  EXPECT_EQ(gemv_default_split_k(p, 132), 8);  // 128 chunks of 64
  p = fake_params(GemvWeight::BF16, 1, 129280, 4096);
  EXPECT_EQ(gemv_default_split_k(p, 132), 8);  // 128 chunks: 16 per warp even at split 8
  p = fake_params(GemvWeight::MXFP4, 1, 2048, 256);
  EXPECT_EQ(gemv_default_split_k(p, 132), 2);  // only 2 chunks of 128 along k
  p = fake_params(GemvWeight::FP8_BLOCK, 1, 34000, 64);
  EXPECT_EQ(gemv_default_split_k(p, 132), 1);  // one chunk, 266 blocks already
  p = fake_params(GemvWeight::MXFP4, 1, 2048, 4096);
  EXPECT_EQ(gemv_default_split_k(p, 132), 8);  // 32 chunks would want split 1, but 16 blocks do not fill 132 SMs
  p = fake_params(GemvWeight::NVFP4, 1, 2048 * 14, 4096);  // the grouped w1 + w3 of 7 experts: their rows together
  EXPECT_EQ(gemv_default_split_k(p, 132), 1);  // 32 chunks per warp, 224 blocks
  p = fake_params(GemvWeight::FP8_BLOCK, 1, 2048 * 14, 4096);
  EXPECT_EQ(gemv_default_split_k(p, 132), 4);  // 64 chunks of 64: 16 per warp
}

TEST(CudaDevice, AvailabilityQueryNeverThrows) {
  bool available = false;
  EXPECT_NO_THROW(available = cuda_available());
  if (available) {
    const DeviceInfo info = device_info(0);
    EXPECT_GT(info.sm_count, 0);
    std::printf("[device] %s, cc %d.%d, %d SMs, %.1f GiB, L2 %.0f MB\n", info.name.c_str(), info.cc_major,
                info.cc_minor, info.sm_count, double(info.global_mem_bytes) / (1 << 30), double(info.l2_bytes) / 1e6);
  }
}

}  // namespace
}  // namespace dsv4
