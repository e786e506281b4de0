// SPDX-License-Identifier: MIT
// Prefill GEMM tests (gemm.h): every format x m in {65, 128, 300, 1024} x output type, on n that are not multiples
// of cuBLASLt's tiles (520, 4104, and 4097 with a padded ldy), k of 1024, 4096 and one that ends in a partial
// 128-block / is not a power of two, padded ldx / ldy and accumulate, against an fp64 reference computed from the
// weights decoded on the host by src/formats. Outputs are poisoned with NaN first: every y[i, 0..n) must be
// written and every padding column left alone. The weight decode kernel is checked bit-exactly against the host
// decode. GPU tests skip without a CUDA driver; the decode argument checks run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/cuda_check.h"
#include "cuda/device.h"
#include "cuda/fp4_layout.h"
#include "cuda/gemm.h"
#include "formats/bf16.h"
#include "formats/blocks.h"
#include "formats/fp4.h"
#include "formats/fp8.h"

namespace dsv4 {
namespace {

#define DSV4_REQUIRE_CUDA() \
  if (!cuda_available()) GTEST_SKIP() << "no CUDA driver or device"

uint64_t fnv1a(const std::string& s) {  // stable seeds: a failing case reruns with the same data
  uint64_t h = 1469598103934665603ull;
  for (const char c : s) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

// ---------------------------------------------------------------------------------------------------------
// Random weights of each format and their host decode.

struct HostWeight {
  GemvWeight weight = GemvWeight::BF16;
  GemvScale fp8_scale = GemvScale::E8M0;
  int n = 0, k = 0;
  std::vector<uint8_t> w, scale;
  float scale_2 = 1.0f;
  std::vector<uint16_t> decoded;  // [n, k] bf16 bits dequantize_weight_bf16 must produce (NVFP4: without scale_2)
};

// full_range: every code (zeros included) and every scale the decode claims exact; otherwise nonzero codes and
// checkpoint-like scales (so sums do not cancel to nothing).
HostWeight make_weight(GemvWeight fmt, GemvScale fp8_scale, int n, int k, bool full_range, std::mt19937_64& rng) {
  HostWeight h;
  h.weight = fmt, h.fp8_scale = fp8_scale, h.n = n, h.k = k;
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mag(0.05f, 1.0f);
  const size_t N = size_t(n), K = size_t(k);
  h.decoded.resize(N * K);
  auto e4m3_code = [&] {
    for (;;) {
      const int v = byte(rng);
      if ((v & 0x7f) == 0x7f) continue;             // NaN: never in weights
      if (!full_range && (v & 0x7f) == 0) continue;  // zero
      return uint8_t(v);
    }
  };
  auto e2m1_code = [&] {
    for (;;) {
      const int v = byte(rng) & 15;
      if (full_range || (v & 7) != 0) return uint8_t(v);
    }
  };
  switch (fmt) {
    case GemvWeight::BF16: {
      h.w.resize(N * K * 2);
      for (size_t i = 0; i < N * K; ++i) {
        const uint16_t b = f32_to_bf16((byte(rng) & 1 ? -1.0f : 1.0f) * mag(rng));
        memcpy(&h.w[2 * i], &b, 2);
        h.decoded[i] = b;
      }
      break;
    }
    case GemvWeight::FP8_BLOCK: {
      const size_t sn = (N + 127) / 128, sk = (K + 127) / 128;
      std::vector<float> s(sn * sk);
      if (fp8_scale == GemvScale::E8M0) {
        h.scale.resize(sn * sk);
        std::uniform_int_distribution<int> e(full_range ? 60 : 118, full_range ? 134 : 130);
        for (size_t i = 0; i < s.size(); ++i) {
          h.scale[i] = uint8_t(e(rng));
          s[i] = e8m0_to_f32(h.scale[i]);
        }
      } else {
        h.scale.resize(sn * sk * 4);
        std::uniform_real_distribution<float> f(1e-3f, 1e-1f);
        for (size_t i = 0; i < s.size(); ++i) {
          s[i] = f(rng);
          memcpy(&h.scale[4 * i], &s[i], 4);
        }
      }
      h.w.resize(N * K);
      for (size_t r = 0; r < N; ++r)
        for (size_t i = 0; i < K; ++i) {
          const uint8_t q = e4m3_code();
          h.w[r * K + i] = q;
          // fp32 product, one rounding to bf16 (exact for e8m0 scales; the contract's rounding for f32 scales).
          h.decoded[r * K + i] = f32_to_bf16(e4m3_to_f32(q) * s[(r / 128) * sk + i / 128]);
        }
      break;
    }
    case GemvWeight::MXFP4:
    case GemvWeight::NVFP4: {
      const bool mx = fmt == GemvWeight::MXFP4;
      const size_t block = mx ? 32 : 16, sk = K / block;
      h.scale.resize(N * sk);
      std::uniform_int_distribution<int> e(full_range ? 2 : 118, 128);
      for (auto& v : h.scale) {
        if (mx) {
          v = uint8_t(e(rng));
        } else {
          for (;;) {  // finite e4m3; full range includes zero, subnormal and negative scales
            const int s = full_range ? byte(rng) : (byte(rng) & 0x7f);
            if ((s & 0x7f) == 0x7f || (!full_range && s == 0)) continue;
            v = uint8_t(s);
            break;
          }
        }
      }
      if (!mx) h.scale_2 = std::uniform_real_distribution<float>(1e-3f, 1e-2f)(rng);
      h.w.resize(N * K / 2);
      for (size_t r = 0; r < N; ++r)
        for (size_t i = 0; i < K; i += 2) {
          const uint8_t lo = e2m1_code(), hi = e2m1_code();
          h.w[(r * K + i) / 2] = pack_fp4_pair(lo, hi);
          const uint8_t sc = h.scale[r * sk + i / block];
          const float s = mx ? e8m0_to_f32(sc) : e4m3_to_f32(sc);
          h.decoded[r * K + i] = f32_to_bf16(e2m1_to_f32(lo) * s);
          h.decoded[r * K + i + 1] = f32_to_bf16(e2m1_to_f32(hi) * s);
        }
      fp4_layout::bytes_to_device(h.w.data(), h.w.size());  // the kernels' bit order (gemv.h)
      break;
    }
  }
  return h;
}

struct DeviceWeight {
  DeviceBuffer w, scale;
  WeightDesc desc;
};

DeviceWeight upload(const HostWeight& h) {
  DeviceWeight d;
  d.w = DeviceBuffer(h.w.size());
  d.w.upload(h.w.data(), h.w.size());
  if (!h.scale.empty()) {
    d.scale = DeviceBuffer(h.scale.size());
    d.scale.upload(h.scale.data(), h.scale.size());
  }
  d.desc.n = h.n, d.desc.k = h.k, d.desc.weight = h.weight, d.desc.fp8_scale = h.fp8_scale;
  d.desc.w = d.w.data(), d.desc.w_scale = h.scale.empty() ? nullptr : d.scale.data();
  return d;
}

std::string format_name(GemvWeight w, GemvScale s) {
  std::string name = gemv_weight_name(w);
  if (w == GemvWeight::FP8_BLOCK) name += s == GemvScale::E8M0 ? "_e8m0" : "_f32scale";
  return name;
}

// ---------------------------------------------------------------------------------------------------------
// Decode kernel: bit-exact against the host decode, all codes.

struct DequantCase {
  GemvWeight weight;
  GemvScale fp8_scale;
  int n, k;
};

class GemmDequantTest : public ::testing::TestWithParam<DequantCase> {};

TEST_P(GemmDequantTest, BitExactAgainstHostDecode) {
  DSV4_REQUIRE_CUDA();
  const DequantCase c = GetParam();
  std::mt19937_64 rng(fnv1a("dequant_" + format_name(c.weight, c.fp8_scale)));
  const HostWeight h = make_weight(c.weight, c.fp8_scale, c.n, c.k, /*full_range=*/true, rng);
  DeviceWeight d = upload(h);
  DeviceBuffer out(h.decoded.size() * 2);
  out.fill_bytes(0xff);
  dequantize_weight_bf16(d.desc, out.as<uint16_t>(), nullptr);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> got(h.decoded.size());
  out.download(got.data(), got.size() * 2);
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const uint16_t want = h.decoded[i];
    // The sign of a zero weight is not part of the contract (it vanishes in the dot product).
    const bool ok = got[i] == want || ((got[i] & 0x7fff) == 0 && (want & 0x7fff) == 0);
    if (!ok && ++bad <= 8)
      ADD_FAILURE() << "element [" << i / size_t(c.k) << ", " << i % size_t(c.k) << "]: got 0x" << std::hex
                    << got[i] << ", want 0x" << want << std::dec << " (" << bf16_to_f32(got[i]) << " vs "
                    << bf16_to_f32(want) << ")";
  }
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(AllFormats, GemmDequantTest,
                         ::testing::Values(DequantCase{GemvWeight::BF16, GemvScale::E8M0, 300, 1000},
                                           DequantCase{GemvWeight::FP8_BLOCK, GemvScale::E8M0, 300, 1040},
                                           DequantCase{GemvWeight::FP8_BLOCK, GemvScale::F32, 300, 1040},
                                           DequantCase{GemvWeight::MXFP4, GemvScale::E8M0, 300, 1056},
                                           DequantCase{GemvWeight::NVFP4, GemvScale::E8M0, 300, 1056}),
                         [](const ::testing::TestParamInfo<DequantCase>& info) {
                           return format_name(info.param.weight, info.param.fp8_scale);
                         });

// ---------------------------------------------------------------------------------------------------------
// GEMM against the fp64 reference.

struct Case {
  GemvWeight weight;
  GemvScale fp8_scale;
  int m, n, k;
  GemvOut out;
  int ldx_pad = 0, ldy_pad = 0;  // extra elements per row beyond k / n
  bool accumulate = false;
};

std::string case_name(const Case& c) {
  std::string s = format_name(c.weight, c.fp8_scale);
  s += "_m" + std::to_string(c.m) + "_n" + std::to_string(c.n) + "_k" + std::to_string(c.k);
  s += c.out == GemvOut::F32 ? "_outf32" : "_outbf16";
  if (c.ldx_pad) s += "_ldxpad" + std::to_string(c.ldx_pad);
  if (c.ldy_pad) s += "_ldypad" + std::to_string(c.ldy_pad);
  if (c.accumulate) s += "_acc";
  return s;
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name(c); }

class GemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(GemmTest, MatchesFp64Reference) {
  DSV4_REQUIRE_CUDA();
  const Case c = GetParam();
  std::mt19937_64 rng(fnv1a(case_name(c)));
  const HostWeight hw = make_weight(c.weight, c.fp8_scale, c.n, c.k, /*full_range=*/false, rng);
  const int64_t ldx = c.k + c.ldx_pad, ldy = c.n + c.ldy_pad;
  const size_t M = size_t(c.m), N = size_t(c.n), K = size_t(c.k);
  const bool f32_out = c.out == GemvOut::F32;
  const size_t out_bytes = f32_out ? 4 : 2;

  std::uniform_real_distribution<float> mag(0.05f, 1.0f);
  std::vector<uint16_t> x(M * size_t(ldx), f32_to_bf16(NAN));  // row padding is NaN: it must never be read
  std::vector<float> xf(M * K);
  for (size_t i = 0; i < M; ++i)
    for (size_t j = 0; j < K; ++j) {
      x[i * size_t(ldx) + j] = f32_to_bf16((rng() & 1 ? -2.0f : 2.0f) * mag(rng));
      xf[i * K + j] = bf16_to_f32(x[i * size_t(ldx) + j]);
    }
  std::vector<float> y0;  // accumulate: the previous contents of y[i, 0..n)
  std::vector<uint8_t> y_init(M * size_t(ldy) * out_bytes, 0xff);  // NaN in both output types
  if (c.accumulate) {
    y0.resize(M * N);
    for (size_t i = 0; i < M; ++i)
      for (size_t j = 0; j < N; ++j) {
        y0[i * N + j] = std::uniform_real_distribution<float>(-4.0f, 4.0f)(rng);
        memcpy(&y_init[(i * size_t(ldy) + j) * 4], &y0[i * N + j], 4);
      }
  }

  DeviceWeight dw = upload(hw);
  DeviceBuffer dx(x.size() * 2), dy(y_init.size());
  dx.upload(x.data(), x.size() * 2);
  dy.upload(y_init.data(), y_init.size());

  GemmParams p;
  p.m = c.m, p.n = c.n, p.k = c.k;
  p.x = dx.data(), p.ldx = c.ldx_pad ? ldx : 0;
  p.weight = c.weight, p.w = dw.desc.w, p.w_scale = dw.desc.w_scale, p.w_scale_2 = hw.scale_2;
  p.fp8_scale = c.fp8_scale;
  p.y = dy.data(), p.ldy = c.ldy_pad ? ldy : 0, p.out = c.out, p.accumulate = c.accumulate;
  GemmContext ctx(gemm_scratch_elements(p));
  ctx.gemm(p);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<uint8_t> raw(y_init.size());
  dy.download(raw.data(), raw.size());
  auto value_at = [&](size_t i, size_t j) {
    const size_t off = (i * size_t(ldy) + j) * out_bytes;
    if (f32_out) {
      float v;
      memcpy(&v, &raw[off], 4);
      return v;
    }
    uint16_t b;
    memcpy(&b, &raw[off], 2);
    return bf16_to_f32(b);
  };

  // Every element written, every padding column untouched (still the 0xff poison bytes).
  int unwritten = 0, clobbered = 0;
  for (size_t i = 0; i < M; ++i) {
    for (size_t j = 0; j < N; ++j) unwritten += !std::isfinite(value_at(i, j));
    for (size_t b = (i * size_t(ldy) + N) * out_bytes; b < (i + 1) * size_t(ldy) * out_bytes; ++b)
      clobbered += raw[b] != 0xff;
  }
  EXPECT_EQ(unwritten, 0) << "non-finite (unwritten) outputs";
  EXPECT_EQ(clobbered, 0) << "bytes written in the ldy padding";

  // Reference on every row when that is cheap, else on the first and last 8 rows and 48 random ones.
  std::vector<size_t> rows;
  if (M * N * K <= (size_t(1) << 28)) {
    for (size_t i = 0; i < M; ++i) rows.push_back(i);
  } else {
    for (size_t i = 0; i < 8; ++i) rows.push_back(i), rows.push_back(M - 1 - i);
    for (int r = 0; r < 48; ++r) rows.push_back(size_t(rng() % M));
  }
  std::vector<float> wf(N * K);
  for (size_t i = 0; i < N * K; ++i) wf[i] = bf16_to_f32(hw.decoded[i]);

  // Bounds, against sum |x w| per output: bf16 products are exact and the error is fp32 accumulation, which
  // grows like sqrt(k) ulps of the running sums (tensor-core adders, cuBLASLt's split of k):
  //   fp32 out  |y - ref| <= 1e-5 * sqrt(k / 1024) * sum|x w|   (+ 2^-23 |y0| when accumulating)
  //   bf16 out  adds 2^-8 |ref| (one round to nearest even, 2^-9, with margin).
  const double acc_bound = 1e-5 * std::sqrt(std::max(1.0, double(K) / 1024.0));
  const double rel_bound = f32_out ? 0.0 : 0x1p-8;
  const double scale_2 = c.weight == GemvWeight::NVFP4 ? double(hw.scale_2) : 1.0;
  double worst_ratio = 0;
  int bad = 0;
  for (const size_t i : rows)
    for (size_t j = 0; j < N; ++j) {
      const float* xr = &xf[i * K];
      const float* wr = &wf[j * K];
      double ref = 0, absum = 0;
      for (size_t t = 0; t < K; ++t) {
        const double prod = double(xr[t]) * double(wr[t]);
        ref += prod;
        absum += std::fabs(prod);
      }
      ref *= scale_2, absum *= scale_2;
      double allowed = rel_bound * std::fabs(ref) + acc_bound * absum;
      if (c.accumulate) {
        ref += double(y0[i * N + j]);
        allowed += 0x1p-23 * std::fabs(double(y0[i * N + j]));
      }
      const float v = value_at(i, j);
      if (!std::isfinite(v)) continue;  // counted above
      const double err = std::fabs(double(v) - ref);
      worst_ratio = std::max(worst_ratio, err / allowed);
      if (!(err <= allowed) && ++bad <= 5)
        ADD_FAILURE() << "y[" << i << ", " << j << "] = " << v << ", reference " << ref << " (allowed error "
                      << allowed << ")";
    }
  EXPECT_EQ(bad, 0);
  std::printf("[gemm] %-56s rows checked %zu  worst err/allowed %.3f\n", case_name(c).c_str(), rows.size(),
              worst_ratio);
}

std::vector<Case> all_cases() {
  struct FormatCase {
    GemvWeight w;
    GemvScale s;
    int k_odd;  // not a power of two; for FP8 not a multiple of the 128 scale block
  };
  const FormatCase formats[] = {
      {GemvWeight::BF16, GemvScale::E8M0, 1000},      {GemvWeight::FP8_BLOCK, GemvScale::E8M0, 1040},
      {GemvWeight::FP8_BLOCK, GemvScale::F32, 1040},  {GemvWeight::MXFP4, GemvScale::E8M0, 1056},
      {GemvWeight::NVFP4, GemvScale::E8M0, 1056},
  };
  const GemvOut f32 = GemvOut::F32, bf16 = GemvOut::BF16;
  std::vector<Case> cases;
  for (const FormatCase& f : formats) {
    cases.push_back({f.w, f.s, 65, 520, f.k_odd, f32});
    cases.push_back({f.w, f.s, 128, 4104, 1024, f32});
    cases.push_back({f.w, f.s, 300, 520, 4096, f32});
    cases.push_back({f.w, f.s, 1024, 4104, 4096, f32});  // reference on sampled rows
    cases.push_back({f.w, f.s, 65, 4104, 1024, bf16});
    cases.push_back({f.w, f.s, 300, 520, f.k_odd, bf16});
    cases.push_back({f.w, f.s, 1024, 520, 4096, bf16});
    // n not a multiple of 8, so ldy must be padded; x rows padded (NaN padding must not be read).
    cases.push_back({f.w, f.s, 128, 4097, f.k_odd, f32, 64, 7});
    cases.push_back({f.w, f.s, 300, 4097, 1024, bf16, 8, 15});
    cases.push_back({f.w, f.s, 65, 520, 4096, f32, 0, 4, /*accumulate=*/true});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllFormats, GemmTest, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return case_name(info.param); });

// ---------------------------------------------------------------------------------------------------------
// Context behaviour and argument checks.

TEST(GemmContextTest, CachesPlansPerShapeAndRejectsSmallScratch) {
  DSV4_REQUIRE_CUDA();
  const int m = 96, n = 256, k = 512;
  DeviceBuffer x(size_t(m) * k * 2), w(size_t(n) * k * 2), y(size_t(m) * n * 4);
  x.fill_bytes(0), w.fill_bytes(0);
  GemmContext ctx(0);  // bf16 weights need no scratch
  GemmParams p;
  p.m = m, p.n = n, p.k = k, p.x = x.data(), p.w = w.data(), p.y = y.data();
  ctx.gemm(p);
  ctx.gemm(p);
  EXPECT_EQ(ctx.cached_plans(), 1u);
  p.m = 80;
  ctx.gemm(p);
  EXPECT_EQ(ctx.cached_plans(), 2u);
  DSV4_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> got(size_t(m) * n);
  y.download(got.data(), got.size() * 4);
  EXPECT_EQ(*std::max_element(got.begin(), got.begin() + 80 * n), 0.0f);

  // An fp8 weight needs n * k scratch elements.
  DeviceBuffer scale(size_t(2) * 4);
  p.weight = GemvWeight::FP8_BLOCK, p.w_scale = scale.data();
  try {
    ctx.gemm(p);
    ADD_FAILURE() << "expected dsv4::Error for a too-small scratch";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scratch"), std::string::npos) << e.what();
  }
}

TEST(GemmContextTest, RejectsBadArguments) {
  DSV4_REQUIRE_CUDA();
  DeviceBuffer buf(size_t(1) << 20);
  GemmContext ctx(size_t(64) * 64);
  auto params = [&] {
    GemmParams p;
    p.m = 64, p.n = 64, p.k = 64, p.x = buf.data(), p.w = buf.data(), p.y = buf.data();
    return p;
  };
  GemmParams p = params();
  p.k = 12;  // bf16 k % 8
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.ldx = 32;  // < k
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.ldx = 68;  // not a multiple of 8
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.ldy = 66;  // f32: not a multiple of 4
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.out = GemvOut::BF16, p.ldy = 68;  // bf16: not a multiple of 8
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.out = GemvOut::BF16, p.accumulate = true;
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.x = static_cast<const char*>(p.x) + 8;  // misaligned
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.weight = GemvWeight::NVFP4;  // no w_scale
  EXPECT_THROW(ctx.gemm(p), Error);
  p = params();
  p.m = 0;
  EXPECT_NO_THROW(ctx.gemm(p));  // empty problem
}

TEST(GemmArgs, DequantRejectsBadWeights) {  // no GPU needed: the checks throw before any CUDA call
  alignas(16) static uint8_t dummy[64];
  uint16_t* out = reinterpret_cast<uint16_t*>(dummy);
  WeightDesc w;
  w.n = 16, w.k = 24, w.weight = GemvWeight::FP8_BLOCK, w.w = dummy, w.w_scale = dummy;
  EXPECT_THROW(dequantize_weight_bf16(w, out, nullptr), Error);  // k % 16
  w.k = 64, w.weight = GemvWeight::MXFP4, w.w_scale = nullptr;
  EXPECT_THROW(dequantize_weight_bf16(w, out, nullptr), Error);  // missing scale
  w.w_scale = dummy, w.w = dummy + 4;
  EXPECT_THROW(dequantize_weight_bf16(w, out, nullptr), Error);  // misaligned w
  w.w = dummy, w.weight = GemvWeight::NVFP4, w.w_scale = dummy + 1;
  EXPECT_THROW(dequantize_weight_bf16(w, out, nullptr), Error);  // nvfp4 scale alignment
  w.weight = GemvWeight::MXFP4, w.w_scale = dummy;
  EXPECT_THROW(dequantize_weight_bf16(w, out + 1, nullptr), Error);  // misaligned out
  try {
    w.k = 48;
    dequantize_weight_bf16(w, out, nullptr);
    ADD_FAILURE() << "expected dsv4::Error for mxfp4 k = 48";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mxfp4"), std::string::npos) << e.what();
  }
  w.n = 0;
  w.k = 64;
  EXPECT_NO_THROW(dequantize_weight_bf16(w, out, nullptr));  // empty weight
  GemmParams p;
  p.n = 4104, p.k = 4096, p.weight = GemvWeight::NVFP4;
  EXPECT_EQ(gemm_scratch_elements(p), size_t(4104) * 4096);
  p.weight = GemvWeight::BF16;
  EXPECT_EQ(gemm_scratch_elements(p), 0u);
}

}  // namespace
}  // namespace dsv4
