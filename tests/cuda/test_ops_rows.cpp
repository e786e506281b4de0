// SPDX-License-Identifier: MIT
// The row-wise kernels of src/cuda/ops_rows.cu at the shapes of a V4-Flash-sized decode step (hidden 4096, hc 4,
// 20 Sinkhorn iterations, head_dim 512 with 64 RoPE dims, q_lora 1024, 64 indexer heads of 128) and of 64-token
// prefill chunks, plus odd sizes and misaligned pointers that take the kernels' scalar paths. References are
// written from the CPU code (src/model/model.cpp, src/cpu/ops.cpp) on the host; every output is poisoned with
// NaN first, so an element the kernel does not write fails.
//   hc_pre: post and comb within 1e-6 relative (the gate arguments and Sinkhorn round like the CPU; only expf
//     may differ in its last bits), normed within 1e-5 of max(1, |want|), normed_bf16 == bf16(normed) exactly.
//   hc_post: within 1e-6 of max(1, |want|) (the same fp32 operations in the same order: normally exact).
//   hc_post_mix: streams bit-identical to hc_post's, the mix within 1e-5 · Σ|x·w| of fp64, hc_pre from its
//     partials bit-identical to hc_pre from their sums.
//   hc_head_norm: bf16 output within 2^-8 relative (+1e-5) of the fp32 reference.
//   linear_f32: |got - want| <= 1e-5 · |scale| · Σ|x·w| against fp64 (reordered fp32 sums; the kernel's bound is
//     (k / 256 + 16) · 2^-24, 4.8e-6 at k = 16384).
//   rms_norm_rows: bf16 outputs within one bf16 rounding step of bf16(cpu::rms_norm) (the fp64 sum of squares is
//     added in another order), from fp32 rows and from a gathered bf16 table; add_to_streams exact.
//   row_op: like the CudaOps tests (no mismatch beyond 1e-5 without rounding, <= 0.5% of elements with FP8 / FP4 /
//     bf16 rounding), and the rounded output must equal src/formats' block functions applied on the host to the
//     kernel's own unrounded output, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/check.h"
#include "cpu/ops.h"
#include "cuda/device.h"
#include "cuda/ops.h"
#include "cuda_test_util.h"
#include "formats/bf16.h"
#include "model/model.h"

namespace dsv4 {
namespace {

using namespace cuda_test;

float host_sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// Elements with |got - want| > rel · |want| (NaN counts), and the largest relative difference.
int count_relative(const std::vector<float>& got, const std::vector<float>& want, double rel, double* worst) {
  int bad = 0;
  *worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(got[i]) - want[i]), scale = std::fabs(double(want[i]));
    if (!(d <= rel * scale)) ++bad;
    if (scale > 0) *worst = std::max(*worst, d / scale);
    if (std::isnan(d)) *worst = INFINITY;
  }
  return bad;
}

double max_abs_diff(const std::vector<float>& got, const std::vector<float>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(got[i]) - want[i]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  return worst;
}

int bits_differ(const std::vector<float>& got, const std::vector<float>& want) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) bad += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
  return bad;
}

std::vector<float> bf16_values(const std::vector<uint16_t>& b) {
  std::vector<float> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_f32(b[i]);
  return v;
}

DeviceBuffer bf16_nan_buffer(size_t n) {
  DeviceBuffer b(std::max<size_t>(n, 1) * sizeof(uint16_t));
  b.fill_bytes(0xff);  // 0xffff: a bf16 NaN
  return b;
}

// Elements whose bf16 value is off by more than a bf16 rounding step plus `abs` from the fp32 reference.
int count_bf16_mismatches(const std::vector<uint16_t>& got, const std::vector<float>& want, double abs) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(bf16_to_f32(got[i])) - want[i]);
    if (!(d <= std::ldexp(std::fabs(double(want[i])), -8) + abs)) ++bad;
  }
  return bad;
}

// ---------------------------------------------------------------------------------------------------------
// hc_pre: the reference is model.cpp's hc_pre (from the given mix) followed by cpu::rms_norm.

struct HcInputs {
  int n, hc, D;
  std::vector<float> streams, mix, base, scale, norm_weight;
};

HcInputs hc_inputs(int n, int hc, int D, int n_mix, uint32_t seed) {
  std::mt19937 rng(seed);
  HcInputs in{n, hc, D, {}, {}, {}, {}, {}};
  in.streams = random_vector(size_t(n) * hc * D, rng, -2.0f, 2.0f);
  in.mix = random_vector(size_t(n) * n_mix, rng, -3.0f, 3.0f);
  in.base = random_vector(n_mix, rng, -1.0f, 1.0f);
  in.scale = random_vector(3, rng, 0.5f, 1.5f);
  in.norm_weight = random_vector(D, rng, 0.5f, 1.5f);
  return in;
}

float host_streams_inv_rms(const float* xs, int width, float eps) {
  double sum_sq = 0;
  for (int i = 0; i < width; ++i) sum_sq += double(xs[i]) * xs[i];
  return 1.0f / std::sqrt(float(sum_sq / width) + eps);
}

struct HcPreWant {
  std::vector<float> post, comb, normed;
};

HcPreWant hc_pre_reference(const HcInputs& in, int iters, float hc_eps, float eps) {
  const int n = in.n, hc = in.hc, D = in.D, n_mix = (2 + hc) * hc;
  HcPreWant want{std::vector<float>(size_t(n) * hc), std::vector<float>(size_t(n) * hc * hc),
                 std::vector<float>(size_t(n) * D)};
  std::vector<float> collapsed(size_t(n) * D);
  for (int t = 0; t < n; ++t) {
    const float* xs = in.streams.data() + size_t(t) * hc * D;
    const float rs = host_streams_inv_rms(xs, hc * D, eps);
    const float* m = in.mix.data() + size_t(t) * n_mix;
    std::vector<float> pre(hc);
    for (int k = 0; k < hc; ++k) {
      pre[k] = host_sigmoid(m[k] * rs * in.scale[0] + in.base[k]) + hc_eps;
      want.post[size_t(t) * hc + k] = 2.0f * host_sigmoid(m[hc + k] * rs * in.scale[1] + in.base[hc + k]);
    }
    float* C = want.comb.data() + size_t(t) * hc * hc;
    for (int j = 0; j < hc; ++j) {
      float* row = C + j * hc;
      float mx = -std::numeric_limits<float>::infinity();
      for (int k = 0; k < hc; ++k) {
        row[k] = m[2 * hc + j * hc + k] * rs * in.scale[2] + in.base[2 * hc + j * hc + k];
        mx = std::max(mx, row[k]);
      }
      float sum = 0;
      for (int k = 0; k < hc; ++k) sum += (row[k] = std::exp(row[k] - mx));
      for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + hc_eps;
    }
    auto normalize_cols = [&] {
      for (int k = 0; k < hc; ++k) {
        float sum = 0;
        for (int j = 0; j < hc; ++j) sum += C[j * hc + k];
        for (int j = 0; j < hc; ++j) C[j * hc + k] /= sum + hc_eps;
      }
    };
    normalize_cols();
    for (int it = 1; it < iters; ++it) {
      for (int j = 0; j < hc; ++j) {
        float sum = 0;
        for (int k = 0; k < hc; ++k) sum += C[j * hc + k];
        for (int k = 0; k < hc; ++k) C[j * hc + k] /= sum + hc_eps;
      }
      normalize_cols();
    }
    float* a = collapsed.data() + size_t(t) * D;
    for (int d = 0; d < D; ++d) {
      float acc = 0;
      for (int k = 0; k < hc; ++k) acc += pre[k] * xs[k * D + d];
      a[d] = acc;
    }
  }
  cpu::rms_norm(collapsed.data(), in.norm_weight.data(), want.normed.data(), n, D, eps);
  return want;
}

struct HcPreCase {
  int n, hc, D;
  bool misaligned;  // streams one float past a 16-byte boundary (scalar loads)
  bool fp32_out;    // normed fp32 as well as bf16
};

void check_hc_pre(const HcPreCase& c, uint32_t seed) {
  const int iters = 20, n_mix = (2 + c.hc) * c.hc;
  const float hc_eps = 1e-6f, eps = 1e-6f;
  const HcInputs in = hc_inputs(c.n, c.hc, c.D, n_mix, seed);
  const HcPreWant want = hc_pre_reference(in, iters, hc_eps, eps);

  const int off = c.misaligned ? 1 : 0;
  std::vector<float> padded(in.streams.size() + 4, 0.0f);
  std::copy(in.streams.begin(), in.streams.end(), padded.begin() + off);
  DeviceBuffer streams = to_device(padded), mix = to_device(in.mix), base = to_device(in.base),
               scale = to_device(in.scale), weight = to_device(in.norm_weight);
  DeviceBuffer post = nan_buffer(want.post.size()), comb = nan_buffer(want.comb.size()),
               normed = nan_buffer(want.normed.size()), normed_bf16 = bf16_nan_buffer(want.normed.size());
  gpu::HcPreParams p;
  p.streams = streams.as<float>() + off;
  p.mix = mix.as<float>();
  p.base = base.as<float>();
  p.scale = scale.as<float>();
  p.norm_weight = weight.as<float>();
  p.n = c.n;
  p.hc = c.hc;
  p.D = c.D;
  p.sinkhorn_iters = iters;
  p.hc_eps = hc_eps;
  p.eps = eps;
  p.post = post.as<float>();
  p.comb = comb.as<float>();
  p.normed = c.fp32_out ? normed.as<float>() : nullptr;
  p.normed_bf16 = normed_bf16.as<uint16_t>();
  gpu::hc_pre(p, nullptr);
  sync();
  {  // The two halves as separate launches write the same bits (the runner's overlap_branches).
    DeviceBuffer post2 = nan_buffer(want.post.size()), comb2 = nan_buffer(want.comb.size()),
                 normed2 = nan_buffer(want.normed.size()), normed_bf16_2 = bf16_nan_buffer(want.normed.size());
    gpu::HcPreParams q = p;
    q.post = post2.as<float>(), q.comb = comb2.as<float>();
    q.normed = c.fp32_out ? normed2.as<float>() : nullptr, q.normed_bf16 = normed_bf16_2.as<uint16_t>();
    q.parts = gpu::HcPreParts::PostComb;
    gpu::hc_pre(q, nullptr);
    sync();
    const std::vector<uint16_t> untouched = to_host<uint16_t>(normed_bf16_2, want.normed.size());
    EXPECT_EQ(std::count(untouched.begin(), untouched.end(), uint16_t(0xffff)), std::ptrdiff_t(untouched.size()))
        << "post + comb alone must not write normed";
    q.parts = gpu::HcPreParts::Collapse;
    q.post = q.comb = nullptr;
    gpu::hc_pre(q, nullptr);
    sync();
    EXPECT_EQ(bits_differ(to_host<float>(post2, want.post.size()), to_host<float>(post, want.post.size())), 0);
    EXPECT_EQ(bits_differ(to_host<float>(comb2, want.comb.size()), to_host<float>(comb, want.comb.size())), 0);
    EXPECT_EQ(to_host<uint16_t>(normed_bf16_2, want.normed.size()), to_host<uint16_t>(normed_bf16, want.normed.size()));
    if (c.fp32_out) {
      EXPECT_EQ(bits_differ(to_host<float>(normed2, want.normed.size()), to_host<float>(normed, want.normed.size())),
                0);
    }
  }

  double post_rel = 0, comb_rel = 0;
  EXPECT_EQ(count_relative(to_host<float>(post, want.post.size()), want.post, 1e-6, &post_rel), 0);
  EXPECT_EQ(count_relative(to_host<float>(comb, want.comb.size()), want.comb, 1e-6, &comb_rel), 0);
  const std::vector<uint16_t> got_bf16 = to_host<uint16_t>(normed_bf16, want.normed.size());
  double normed_diff = 0;
  if (c.fp32_out) {
    const std::vector<float> got = to_host<float>(normed, want.normed.size());
    EXPECT_EQ(count_mismatches(got, want.normed, 1e-5), 0);
    normed_diff = max_abs_diff(got, want.normed);
    int bad_bf16 = 0;
    for (size_t i = 0; i < got.size(); ++i) bad_bf16 += got_bf16[i] != f32_to_bf16(got[i]);
    EXPECT_EQ(bad_bf16, 0) << "normed_bf16 is not the bf16 of normed";
  } else {
    EXPECT_EQ(count_bf16_mismatches(got_bf16, want.normed, 1e-5), 0);
  }
  std::printf("[hc_pre] n=%d hc=%d D=%d misaligned=%d: post max rel %.3g, comb max rel %.3g, normed max|diff| %.3g\n",
              c.n, c.hc, c.D, int(c.misaligned), post_rel, comb_rel, normed_diff);
}

TEST(OpsRowsHcPre, DecodeAndPrefillShapes) {
  DSV4_REQUIRE_CUDA();
  check_hc_pre({1, 4, 4096, false, true}, 1);
  check_hc_pre({64, 4, 4096, false, true}, 2);
  check_hc_pre({33, 4, 4096, false, true}, 13);  // decode batch: five tokens per cluster, the last one three
  check_hc_pre({100, 4, 1000, false, true}, 14);  // prefill: threads past the row's column groups
  check_hc_pre({1, 4, 4096, false, false}, 3);  // bf16 only, as the runner's ffn / attn norms could
}

TEST(OpsRowsHcPre, OddSizesAndMisalignedStreams) {
  DSV4_REQUIRE_CUDA();
  check_hc_pre({1, 4, 4104, false, true}, 4);   // more column groups than threads
  check_hc_pre({64, 4, 4104, false, true}, 5);
  check_hc_pre({1, 4, 96, false, true}, 6);     // one warp
  check_hc_pre({3, 4, 4099, false, true}, 7);   // D % 4 != 0: scalar loads and stores
  check_hc_pre({2, 4, 4096, true, true}, 8);    // streams not 16-byte aligned
  check_hc_pre({2, 6, 96, false, true}, 9);     // hc 6: 36 Sinkhorn cells, two per lane
  check_hc_pre({1, 8, 1000, false, true}, 10);  // hc 8, the contract's limit
  check_hc_pre({70, 8, 1000, false, true}, 11);  // prefill rows (256 threads each), hc 8
  check_hc_pre({65, 4, 4099, false, true}, 12);  // prefill rows, scalar loads
  check_hc_pre({2, 1, 64, false, true}, 11);
}

// HcPreParams::fn: hc_pre computes the mix = streams · fnᵀ itself (decode-sized chunks inside the collapse's
// cluster, others through linear_f32 first). mix_out against an fp64 mix (|diff| <= 1e-5 of Σ|terms|); then post,
// comb and normed against the reference run from the mix the GPU wrote (so the gates' tolerances stay those of
// check_hc_pre), and the collapse + post + comb as separate launches give the same bits as one call.
void check_hc_pre_from_fn(int n, int D, uint32_t seed) {
  const int hc = 4, iters = 20, n_mix = (2 + hc) * hc, width = hc * D;
  const float hc_eps = 1e-6f, eps = 1e-6f;
  HcInputs in = hc_inputs(n, hc, D, n_mix, seed);
  std::mt19937 rng(seed + 100);
  const float bound = 2.0f / std::sqrt(float(width));
  const std::vector<float> fn = random_vector(size_t(n_mix) * width, rng, -bound, bound);
  std::vector<double> mix64(size_t(n) * n_mix), mix_abs(size_t(n) * n_mix);
  for (int t = 0; t < n; ++t)
    for (int m = 0; m < n_mix; ++m)
      for (int j = 0; j < width; ++j) {
        const double term = double(in.streams[size_t(t) * width + j]) * fn[size_t(m) * width + j];
        mix64[size_t(t) * n_mix + m] += term;
        mix_abs[size_t(t) * n_mix + m] += std::fabs(term);
      }
  DeviceBuffer streams = to_device(in.streams), dfn = to_device(fn), base = to_device(in.base),
               scale = to_device(in.scale), weight = to_device(in.norm_weight);
  auto run = [&](gpu::HcPreParts parts, DeviceBuffer& mix, DeviceBuffer& post, DeviceBuffer& comb,
                 DeviceBuffer& normed) {
    gpu::HcPreParams p;
    p.streams = streams.as<float>();
    p.fn = dfn.as<float>();
    p.mix_out = mix.as<float>();
    p.base = base.as<float>();
    p.scale = scale.as<float>();
    p.norm_weight = weight.as<float>();
    p.n = n;
    p.hc = hc;
    p.D = D;
    p.sinkhorn_iters = iters;
    p.hc_eps = hc_eps;
    p.eps = eps;
    p.post = post.as<float>();
    p.comb = comb.as<float>();
    p.normed = normed.as<float>();
    p.parts = parts;
    const int kernels = gpu::hc_pre(p, nullptr);
    if (parts == gpu::HcPreParts::Collapse) {
      p.parts = gpu::HcPreParts::PostComb;
      p.fn = nullptr;
      p.mix = mix.as<float>();
      gpu::hc_pre(p, nullptr);
    }
    sync();
    return kernels;
  };
  DeviceBuffer mix = nan_buffer(size_t(n) * n_mix), post = nan_buffer(size_t(n) * hc),
               comb = nan_buffer(size_t(n) * hc * hc), normed = nan_buffer(size_t(n) * D);
  const int kernels = run(gpu::HcPreParts::Both, mix, post, comb, normed);
  const std::vector<float> got_mix = to_host<float>(mix, mix64.size());
  int bad_mix = 0;
  double worst = 0;
  for (size_t i = 0; i < mix64.size(); ++i) {
    const double d = std::fabs(got_mix[i] - mix64[i]) / mix_abs[i];
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
    bad_mix += !(d <= 1e-5);
  }
  EXPECT_EQ(bad_mix, 0);
  in.mix = got_mix;
  const HcPreWant want = hc_pre_reference(in, iters, hc_eps, eps);
  double post_rel = 0, comb_rel = 0;
  EXPECT_EQ(count_relative(to_host<float>(post, want.post.size()), want.post, 1e-6, &post_rel), 0);
  EXPECT_EQ(count_relative(to_host<float>(comb, want.comb.size()), want.comb, 1e-6, &comb_rel), 0);
  EXPECT_EQ(count_mismatches(to_host<float>(normed, want.normed.size()), want.normed, 1e-5), 0);

  DeviceBuffer mix2 = nan_buffer(size_t(n) * n_mix), post2 = nan_buffer(size_t(n) * hc),
               comb2 = nan_buffer(size_t(n) * hc * hc), normed2 = nan_buffer(size_t(n) * D);
  const int collapse_kernels = run(gpu::HcPreParts::Collapse, mix2, post2, comb2, normed2);
  const bool in_cluster = n < 64 && D % 64 == 0;  // ops.h: the mix inside the collapse's cluster
  EXPECT_EQ(collapse_kernels, in_cluster ? 1 : 2);
  EXPECT_EQ(bits_differ(to_host<float>(mix2, got_mix.size()), got_mix), 0);
  EXPECT_EQ(bits_differ(to_host<float>(post2, want.post.size()), to_host<float>(post, want.post.size())), 0);
  EXPECT_EQ(bits_differ(to_host<float>(comb2, want.comb.size()), to_host<float>(comb, want.comb.size())), 0);
  EXPECT_EQ(bits_differ(to_host<float>(normed2, want.normed.size()), to_host<float>(normed, want.normed.size())), 0);
  std::printf("[hc_pre fn] n=%d D=%d: %d kernels, mix max |diff| / Σ|terms| %.3g, post max rel %.3g, comb max rel "
              "%.3g\n", n, D, kernels, worst, post_rel, comb_rel);
}

TEST(OpsRowsHcPre, ComputesItsMixFromFn) {
  DSV4_REQUIRE_CUDA();
  check_hc_pre_from_fn(1, 4096, 21);   // decode: mix inside the collapse's cluster
  check_hc_pre_from_fn(5, 4096, 22);
  check_hc_pre_from_fn(40, 4096, 26);  // five tokens per cluster
  check_hc_pre_from_fn(63, 128, 27);   // eight tokens per cluster, the last one seven
  check_hc_pre_from_fn(3, 64, 23);     // one column group per block
  check_hc_pre_from_fn(2, 4104, 24);   // D % 64 != 0: linear_f32 first
  check_hc_pre_from_fn(64, 1024, 25);  // a prefill chunk: linear_f32 (tall) first
}

// hc_post against model.cpp's hc_post (out = the sum of the picks, then the shared expert's output).

// hc_post's inputs: the sublayer's output picks, a shared expert's output, post, comb and the streams.
struct HcPostInputs {
  std::vector<float> out, shared, post, comb, streams;
  HcPostInputs(int n, int hc, int D, int out_k, std::mt19937& rng)
      : out(random_vector(size_t(n) * out_k * D, rng, -2.0f, 2.0f)),
        shared(random_vector(size_t(n) * D, rng, -2.0f, 2.0f)),
        post(random_vector(size_t(n) * hc, rng, 0.0f, 2.0f)),
        comb(random_vector(size_t(n) * hc * hc, rng, 0.0f, 1.0f)),
        streams(random_vector(size_t(n) * hc * D, rng, -2.0f, 2.0f)) {}
};

void check_hc_post(int n, int hc, int D, int out_k, bool out2, bool misaligned, uint32_t seed) {
  std::mt19937 rng(seed);
  const HcPostInputs in(n, hc, D, out_k, rng);
  const std::vector<float>&out = in.out, &shared = in.shared, &post = in.post, &comb = in.comb, &streams = in.streams;
  std::vector<float> want = streams;
  for (int t = 0; t < n; ++t) {
    const float* C = &comb[size_t(t) * hc * hc];
    const float* old = &streams[size_t(t) * hc * D];
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < D; ++d) {
        float o = out[(size_t(t) * out_k) * D + d];
        for (int e = 1; e < out_k; ++e) o += out[(size_t(t) * out_k + e) * D + d];
        if (out2) o += shared[size_t(t) * D + d];
        float acc = post[size_t(t) * hc + k] * o;
        for (int j = 0; j < hc; ++j) acc += C[j * hc + k] * old[size_t(j) * D + d];
        want[(size_t(t) * hc + k) * D + d] = acc;
      }
  }
  const int off = misaligned ? 1 : 0;
  std::vector<float> padded(streams.size() + 4, 0.0f);
  std::copy(streams.begin(), streams.end(), padded.begin() + off);
  DeviceBuffer d_out = to_device(out), d_shared = to_device(shared), d_post = to_device(post),
               d_comb = to_device(comb), d_streams = to_device(padded);
  gpu::hc_post(d_out.as<float>(), out_k, out2 ? d_shared.as<float>() : nullptr, d_post.as<float>(),
               d_comb.as<float>(), n, hc, D, d_streams.as<float>() + off, nullptr);
  sync();
  const std::vector<float> all = to_host<float>(d_streams, padded.size());
  const std::vector<float> got(all.begin() + off, all.begin() + off + long(want.size()));
  EXPECT_EQ(count_mismatches(got, want, 1e-6), 0);
  std::printf("[hc_post] n=%d hc=%d D=%d out_k=%d out2=%d misaligned=%d: max|diff| %.3g\n", n, hc, D, out_k,
              int(out2), int(misaligned), max_abs_diff(got, want));
}

TEST(OpsRowsHcPost, DecodePrefillAndOddShapes) {
  DSV4_REQUIRE_CUDA();
  check_hc_post(1, 4, 4096, 1, false, false, 21);  // attention output
  check_hc_post(1, 4, 4096, 6, true, false, 22);   // routed picks + shared expert
  check_hc_post(64, 4, 4096, 6, true, false, 23);
  check_hc_post(3, 4, 4099, 2, true, false, 24);   // D % 4 != 0: the scalar kernel
  check_hc_post(2, 4, 4096, 3, false, true, 25);   // misaligned streams: the scalar kernel
  check_hc_post(2, 8, 96, 2, true, false, 26);
}

// HcPreParams::prev_out: hc_pre applies the previous sublayer's mHC post first (inside the cluster collapse for
// decode-sized chunks, an hc_post launch first elsewhere). Against hc_post then hc_pre: the same bits in the
// updated streams, the mix, post, comb and normed, with the collapse and post + comb in one call or apart (the
// runner's overlap_branches), with fn (the mix in the cluster) and with a given mix.
void check_hc_pre_after_post(int n, int D, int out_k, bool out2, bool with_fn, uint32_t seed) {
  SCOPED_TRACE("n " + std::to_string(n) + " D " + std::to_string(D) + " out_k " + std::to_string(out_k) +
               (with_fn ? " fn" : " mix"));
  const int hc = 4, n_mix = (2 + hc) * hc, width = hc * D;
  std::mt19937 rng(seed);
  const HcPostInputs prev(n, hc, D, out_k, rng);
  const HcInputs in = hc_inputs(n, hc, D, n_mix, seed + 1);
  const float bound = 2.0f / std::sqrt(float(width));
  const std::vector<float> fn = random_vector(size_t(n_mix) * width, rng, -bound, bound);
  DeviceBuffer d_out = to_device(prev.out), d_shared = to_device(prev.shared), dfn = to_device(fn),
               dmix_in = to_device(in.mix), base = to_device(in.base), scale = to_device(in.scale),
               weight = to_device(in.norm_weight);
  struct Result {
    std::vector<float> streams, mix, post, comb, normed;
  };
  auto run = [&](bool fused, bool apart) {
    DeviceBuffer streams = to_device(prev.streams), post = to_device(prev.post), comb = to_device(prev.comb),
                 mix = nan_buffer(size_t(n) * n_mix), normed = nan_buffer(size_t(n) * D);
    gpu::HcPreParams p;
    p.streams = streams.as<float>();
    if (with_fn) {
      p.fn = dfn.as<float>();
      p.mix_out = mix.as<float>();
    } else {
      p.mix = dmix_in.as<float>();
    }
    p.base = base.as<float>(), p.scale = scale.as<float>(), p.norm_weight = weight.as<float>();
    p.n = n, p.hc = hc, p.D = D, p.sinkhorn_iters = 20;
    p.post = post.as<float>(), p.comb = comb.as<float>(), p.normed = normed.as<float>();
    const float* shared = out2 ? d_shared.as<float>() : nullptr;
    if (fused) {
      p.prev_out = d_out.as<float>(), p.prev_out_k = out_k, p.prev_out2 = shared;
    } else {
      gpu::hc_post(d_out.as<float>(), out_k, shared, post.as<float>(), comb.as<float>(), n, hc, D,
                   streams.as<float>(), nullptr);
    }
    if (apart) {
      p.parts = gpu::HcPreParts::Collapse;
      gpu::hc_pre(p, nullptr);
      p.parts = gpu::HcPreParts::PostComb;
      p.prev_out = p.prev_out2 = nullptr;
      if (with_fn) {
        p.fn = nullptr;
        p.mix = mix.as<float>();
      }
    }
    gpu::hc_pre(p, nullptr);
    sync();
    return Result{to_host<float>(streams, prev.streams.size()), to_host<float>(mix, size_t(n) * n_mix),
                  to_host<float>(post, prev.post.size()), to_host<float>(comb, prev.comb.size()),
                  to_host<float>(normed, size_t(n) * D)};
  };
  const Result want = run(false, false);
  EXPECT_GT(bits_differ(want.streams, prev.streams), want.streams.size() / 2) << "hc_post did not run";
  for (const bool apart : {false, true}) {
    const Result got = run(true, apart);
    EXPECT_EQ(bits_differ(got.streams, want.streams), 0) << "apart " << apart;
    if (with_fn) EXPECT_EQ(bits_differ(got.mix, want.mix), 0) << "apart " << apart;
    EXPECT_EQ(bits_differ(got.post, want.post), 0) << "apart " << apart;
    EXPECT_EQ(bits_differ(got.comb, want.comb), 0) << "apart " << apart;
    EXPECT_EQ(bits_differ(got.normed, want.normed), 0) << "apart " << apart;
  }
}

TEST(OpsRowsHcPre, AppliesThePreviousPost) {
  DSV4_REQUIRE_CUDA();
  check_hc_pre_after_post(1, 4096, 7, true, true, 31);    // decode FFN -> attention: picks + shared, mix in the cluster
  check_hc_pre_after_post(5, 4096, 1, false, true, 32);   // attention -> FFN at batch 5
  check_hc_pre_after_post(40, 4096, 7, true, false, 33);  // five tokens per cluster, a given mix
  check_hc_pre_after_post(3, 64, 2, true, true, 34);      // one column group per block
  check_hc_pre_after_post(2, 4104, 7, true, true, 35);    // D % 64 != 0: an hc_post launch first
  check_hc_pre_after_post(64, 1024, 1, false, true, 36);  // a prefill chunk
}


// ---------------------------------------------------------------------------------------------------------
// hc_post_mix: the streams exactly as hc_post leaves them; the partials, added in block order on the host (as hc_pre
// adds them), within 1e-5 · Σ|x·w| of the fp64 mix of the updated streams; and hc_pre from the partials gives the
// same bits as hc_pre from those sums.

void check_hc_post_mix(int n, int D, int out_k, bool out2, int n_mix, uint32_t seed) {
  constexpr int hc = 4;
  std::mt19937 rng(seed);
  const HcPostInputs in(n, hc, D, out_k, rng);
  const std::vector<float>&out = in.out, &shared = in.shared, &post = in.post, &comb = in.comb, &streams = in.streams;
  const std::vector<float> fn = random_vector(size_t(n_mix) * hc * D, rng, -0.05f, 0.05f);
  DeviceBuffer d_out = to_device(out), d_shared = to_device(shared), d_post = to_device(post),
               d_comb = to_device(comb), d_fn = to_device(fn), plain = to_device(streams), fused = to_device(streams);
  gpu::hc_post(d_out.as<float>(), out_k, out2 ? d_shared.as<float>() : nullptr, d_post.as<float>(),
               d_comb.as<float>(), n, hc, D, plain.as<float>(), nullptr);
  const int blocks = gpu::hc_post_mix_blocks(D);
  DeviceBuffer partials = nan_buffer(size_t(n) * n_mix * blocks);
  gpu::hc_post_mix({d_out.as<float>(), out_k, out2 ? d_shared.as<float>() : nullptr, d_post.as<float>(),
                    d_comb.as<float>(), n, hc, D, fused.as<float>(), d_fn.as<float>(), n_mix, partials.as<float>()},
                   nullptr);
  sync();
  const std::vector<float> want_streams = to_host<float>(plain, streams.size());
  const std::vector<float> got_streams = to_host<float>(fused, streams.size());
  int differ = 0;
  for (size_t i = 0; i < streams.size(); ++i) differ += std::memcmp(&got_streams[i], &want_streams[i], 4) != 0;
  EXPECT_EQ(differ, 0) << "hc_post_mix's streams are not hc_post's";

  const std::vector<float> part = to_host<float>(partials, size_t(n) * n_mix * blocks);
  std::vector<float> mix(size_t(n) * n_mix);
  int bad = 0;
  double worst = 0;  // in units of the bound
  for (int t = 0; t < n; ++t)
    for (int m = 0; m < n_mix; ++m) {
      float sum = 0.0f;
      for (int b = 0; b < blocks; ++b) sum += part[(size_t(t) * n_mix + m) * blocks + b];
      mix[size_t(t) * n_mix + m] = sum;
      double want = 0, mag = 0;
      for (int i = 0; i < hc * D; ++i) {
        const double prod = double(want_streams[size_t(t) * hc * D + i]) * fn[size_t(m) * hc * D + i];
        want += prod;
        mag += std::fabs(prod);
      }
      const double d = std::fabs(double(sum) - want), bound = 1e-5 * mag + 1e-30;
      if (!(d <= bound)) ++bad;
      worst = std::isnan(d) ? INFINITY : std::max(worst, d / bound);
    }
  EXPECT_EQ(bad, 0) << bad << " mix outputs beyond 1e-5 · Σ|x·w|";

  int pre_differ = 0;
  if (n_mix == (2 + hc) * hc) {  // hc_pre from the partials and from their sums
    const std::vector<float> base = random_vector(size_t(n_mix), rng, -0.5f, 0.5f);
    const std::vector<float> scale = random_vector(3, rng, 0.5f, 1.5f);
    const std::vector<float> weight = random_vector(size_t(D), rng, 0.5f, 1.5f);
    DeviceBuffer d_mix = to_device(mix), d_base = to_device(base), d_scale = to_device(scale),
                 d_weight = to_device(weight);
    std::vector<std::vector<float>> outputs;
    for (bool from_partials : {false, true}) {
      DeviceBuffer d_post_out = nan_buffer(size_t(n) * hc), d_comb_out = nan_buffer(size_t(n) * hc * hc),
                   d_normed = nan_buffer(size_t(n) * D);
      gpu::HcPreParams p;
      p.streams = fused.as<float>();
      p.mix = from_partials ? nullptr : d_mix.as<float>();
      p.mix_partials = from_partials ? partials.as<float>() : nullptr;
      p.mix_blocks = from_partials ? blocks : 0;
      p.base = d_base.as<float>();
      p.scale = d_scale.as<float>();
      p.norm_weight = d_weight.as<float>();
      p.n = n;
      p.hc = hc;
      p.D = D;
      p.sinkhorn_iters = 20;
      p.post = d_post_out.as<float>();
      p.comb = d_comb_out.as<float>();
      p.normed = d_normed.as<float>();
      gpu::hc_pre(p, nullptr);
      sync();
      std::vector<float> all = to_host<float>(d_post_out, size_t(n) * hc);
      const std::vector<float> c2 = to_host<float>(d_comb_out, size_t(n) * hc * hc);
      const std::vector<float> n2 = to_host<float>(d_normed, size_t(n) * D);
      all.insert(all.end(), c2.begin(), c2.end());
      all.insert(all.end(), n2.begin(), n2.end());
      outputs.push_back(all);
    }
    for (size_t i = 0; i < outputs[0].size(); ++i)
      pre_differ += std::memcmp(&outputs[0][i], &outputs[1][i], 4) != 0 || std::isnan(outputs[1][i]);
    EXPECT_EQ(pre_differ, 0) << "hc_pre from partials differs from hc_pre from their sums";
  }
  std::printf("[hc_post_mix] n=%d D=%d out_k=%d out2=%d n_mix=%d: %d blocks, mix worst %.3g of the bound, hc_pre "
              "outputs differing %d\n", n, D, out_k, int(out2), n_mix, blocks, worst, pre_differ);
}

TEST(OpsRowsHcPostMix, DecodeShapes) {
  DSV4_REQUIRE_CUDA();
  check_hc_post_mix(1, 4096, 1, false, 24, 61);  // after attention: the ffn's mix
  check_hc_post_mix(1, 4096, 6, true, 24, 62);   // after the routed picks + shared expert: the next layer's mix
  check_hc_post_mix(64, 4096, 6, true, 24, 63);  // a decode batch of 64
  check_hc_post_mix(3, 7168, 2, false, 24, 64);  // V4-Pro's hidden size
  check_hc_post_mix(2, 100, 1, true, 24, 65);    // a partial block (25 column groups)
  check_hc_post_mix(1, 4096, 1, false, 4, 66);   // a head-sized mix
}

TEST(OpsRowsHcPostMix, RejectsWhatItCannotRun) {
  DSV4_REQUIRE_CUDA();
  gpu::HcPostMixParams p;
  p.n = 1;
  p.hc = 8;
  p.D = 64;
  p.n_mix = 24;
  EXPECT_THROW(gpu::hc_post_mix(p, nullptr), Error);  // hc 8
  p.hc = 4;
  p.n_mix = 25;
  EXPECT_THROW(gpu::hc_post_mix(p, nullptr), Error);  // more outputs than accumulators
  p.n_mix = 24;
  p.D = 66;
  EXPECT_THROW(gpu::hc_post_mix(p, nullptr), Error);  // D % 4 != 0
}

// ---------------------------------------------------------------------------------------------------------
// hc_head_norm against model.cpp's hc_head followed by cpu::rms_norm.

void check_hc_head(int n, int hc, int D, uint32_t seed) {
  const float hc_eps = 1e-6f, eps = 1e-6f;
  const HcInputs in = hc_inputs(n, hc, D, hc, seed);
  std::vector<float> y(size_t(n) * D, 0.0f), want(size_t(n) * D);
  for (int t = 0; t < n; ++t) {
    const float* xs = in.streams.data() + size_t(t) * hc * D;
    const float rs = host_streams_inv_rms(xs, hc * D, eps);
    for (int k = 0; k < hc; ++k) {
      const float pre = host_sigmoid(in.mix[size_t(t) * hc + k] * rs * in.scale[0] + in.base[k]) + hc_eps;
      for (int d = 0; d < D; ++d) y[size_t(t) * D + d] += pre * xs[k * D + d];
    }
  }
  cpu::rms_norm(y.data(), in.norm_weight.data(), want.data(), n, D, eps);
  DeviceBuffer streams = to_device(in.streams), mix = to_device(in.mix), base = to_device(in.base),
               scale = to_device(in.scale), weight = to_device(in.norm_weight);
  DeviceBuffer out = bf16_nan_buffer(want.size());
  gpu::hc_head_norm(streams.as<float>(), mix.as<float>(), base.as<float>(), scale.as<float>(), weight.as<float>(), n,
                    hc, D, hc_eps, eps, out.as<uint16_t>(), nullptr);
  sync();
  const std::vector<uint16_t> got = to_host<uint16_t>(out, want.size());
  EXPECT_EQ(count_bf16_mismatches(got, want, 1e-5), 0);
  std::printf("[hc_head_norm] n=%d hc=%d D=%d: max|diff| %.3g (bf16 output)\n", n, hc, D,
              max_abs_diff(bf16_values(got), want));
}

TEST(OpsRowsHcHead, DecodePrefillAndOddShapes) {
  DSV4_REQUIRE_CUDA();
  check_hc_head(1, 4, 4096, 31);
  check_hc_head(64, 4, 4096, 32);
  check_hc_head(2, 4, 4099, 33);
  check_hc_head(1, 4, 4104, 34);
  check_hc_head(2, 7, 200, 35);
}

// ---------------------------------------------------------------------------------------------------------
// linear_f32 against fp64 sums.

void check_linear_f32(int m, int n, int k, float scale, int x_offset, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<float> x = random_vector(size_t(m) * k + x_offset, rng);
  const std::vector<float> w = random_vector(size_t(n) * k, rng);
  std::vector<double> want(size_t(m) * n), bound(size_t(m) * n);
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < n; ++c) {
      double acc = 0, mag = 0;
      for (int i = 0; i < k; ++i) {
        const double prod = double(x[x_offset + size_t(r) * k + i]) * w[size_t(c) * k + i];
        acc += prod;
        mag += std::fabs(prod);
      }
      want[size_t(r) * n + c] = acc * scale;
      bound[size_t(r) * n + c] = 1e-5 * std::fabs(scale) * mag + 1e-30;
    }
  DeviceBuffer dx = to_device(x), dw = to_device(w), dy = nan_buffer(want.size());
  const bool built_tiles = gpu::linear_f32_tiles();
  for (const bool tiles : {false, true}) {  // prefill-sized calls: the 4-row blocks and the 32-row cluster tiles
    if (tiles && m < 64) continue;
    gpu::set_linear_f32_tiles(tiles);
    dy.fill_bytes(0xff);
    gpu::linear_f32({dx.as<float>() + x_offset, dw.as<float>(), dy.as<float>(), m, n, k, scale}, nullptr);
    sync();
    const std::vector<float> got = to_host<float>(dy, want.size());
    int bad = 0;
    double worst = 0;  // in units of the bound
    for (size_t i = 0; i < want.size(); ++i) {
      const double d = std::fabs(double(got[i]) - want[i]);
      if (!(d <= bound[i])) ++bad;
      worst = std::isnan(d) ? INFINITY : std::max(worst, d / bound[i]);
    }
    EXPECT_EQ(bad, 0) << bad << " of " << want.size() << " outputs beyond 1e-5 · Σ|x·w| (tiles " << tiles << ")";
    std::printf("[linear_f32] m=%d n=%d k=%d x_offset=%d tiles=%d: worst |diff| = %.3g of the bound\n", m, n, k,
                x_offset, int(tiles), worst);
  }
  gpu::set_linear_f32_tiles(built_tiles);
}

TEST(OpsRowsLinearF32, DecodeShapes) {
  DSV4_REQUIRE_CUDA();
  check_linear_f32(1, 24, 16384, 1.0f, 0, 41);   // mHC mix
  check_linear_f32(1, 4, 16384, 1.0f, 0, 42);    // head mix
  check_linear_f32(1, 32, 4096, 1.0f, 0, 43);    // router gate (tiny config)
  check_linear_f32(1, 256, 4096, 1.0f, 0, 44);   // router gate (real model)
  check_linear_f32(1, 64, 4096, 0.25f, 0, 45);   // indexer weights_proj
}

TEST(OpsRowsLinearF32, PrefillShapes) {
  DSV4_REQUIRE_CUDA();
  check_linear_f32(64, 24, 16384, 1.0f, 0, 46);
  check_linear_f32(64, 64, 4096, 1.0f, 0, 47);
  check_linear_f32(64, 256, 4096, 1.0f, 0, 48);
  check_linear_f32(6, 24, 16384, 1.0f, 0, 49);   // a partial group of four rows
  // from 64 rows: 4-row blocks or 32-row cluster tiles of up to 32 columns (groups of 8 / 16 / 24 / 32, partial ones)
  check_linear_f32(512, 24, 16384, 1.0f, 0, 54);  // mHC mix of a 512-token chunk
  check_linear_f32(130, 4, 16384, 1.0f, 0, 55);   // head mix, partial row group
  check_linear_f32(101, 64, 4096, 0.25f, 0, 56);  // indexer weights_proj: two column groups
  check_linear_f32(70, 257, 4096, 1.0f, 0, 57);   // router gate + 1: a last group of one column
  check_linear_f32(64, 13, 2048, -1.0f, 4, 58);   // x offset by 16 bytes
  check_linear_f32(96, 24, 1000, 1.0f, 0, 59);   // k not a multiple of the tiles' 64-float chunks
  check_linear_f32(64, 8, 256, 1.0f, 0, 60);     // k-slices of the cluster without a chunk
}

TEST(OpsRowsLinearF32, OddKAndMisalignedPointers) {
  DSV4_REQUIRE_CUDA();
  check_linear_f32(3, 7, 1001, 1.0f, 0, 51);     // k % 4 != 0: scalar loads
  check_linear_f32(5, 33, 4097, -0.5f, 0, 52);
  check_linear_f32(1, 24, 16383, 1.0f, 0, 53);   // split k, scalar loads
  check_linear_f32(1, 24, 16384, 1.0f, 1, 54);   // x one float past 16-byte alignment
  check_linear_f32(2, 5, 3, 1.0f, 0, 55);        // fewer values than threads
  check_linear_f32(1, 3, 0, 1.0f, 0, 56);        // k = 0 writes zeros
}

// ---------------------------------------------------------------------------------------------------------
// row_op at the runner's shapes.

struct RowShape {
  int tokens, heads, dim, rope_dim;
  bool norm, weight;
  gpu::RowRound round;
  int x_pad = 0;          // extra floats between heads / tokens (strided input like the fused projections)
  bool in_place = false;  // y == x
  bool fp32_out = true;   // false: only the bf16 copy
  bool inverse = false;
};

std::vector<float> rope_freqs(int rope_dim) {
  RopeConfig rope;
  rope.theta = 160000;
  rope.yarn = true;
  rope.factor = 16;
  rope.original_max_position = 65536;
  return rope_dim ? rope_inv_freq(rope, rope_dim) : std::vector<float>{0.0f};
}

void host_round(float* y, const RowShape& s) {
  switch (s.round) {
    case gpu::RowRound::None: break;
    case gpu::RowRound::Bf16: cpu::round_kv(y, s.dim, s.rope_dim, cpu::KvStorage::BF16); break;
    case gpu::RowRound::KvFp8: cpu::round_kv(y, s.dim, s.rope_dim, cpu::KvStorage::FP8); break;
    case gpu::RowRound::IndexerFp4: cpu::round_indexer(y, s.dim, cpu::IndexerStorage::FP4); break;
  }
}

// Runs row_op on x (rows of stride dim + x_pad, heads then tokens); returns y [rows, dim] and its bf16 copy.
void run_row_op(const RowShape& s, gpu::RowRound round, const std::vector<float>& x, const std::vector<float>& weight,
                const std::vector<float>& inv_freq, int64_t pos0, int pos_step, std::vector<float>* y,
                std::vector<uint16_t>* y_bf16) {
  const int rows = s.tokens * s.heads, stride = s.dim + s.x_pad;
  DeviceBuffer dx = to_device(x), dw = to_device(weight), df = to_device(inv_freq);
  DeviceBuffer dy = nan_buffer(size_t(rows) * s.dim), dyb = bf16_nan_buffer(size_t(rows) * s.dim);
  gpu::RowOpParams p;
  p.x = dx.as<float>();
  p.x_token_stride = int64_t(s.heads) * stride;
  p.x_head_stride = stride;
  if (s.in_place) {
    p.y = dx.as<float>();
    p.y_token_stride = p.x_token_stride;
    p.y_head_stride = p.x_head_stride;
  } else {
    p.y = s.fp32_out ? dy.as<float>() : nullptr;
    p.y_token_stride = int64_t(s.heads) * s.dim;
    p.y_head_stride = s.dim;
  }
  p.y_bf16 = dyb.as<uint16_t>();
  p.tokens = s.tokens;
  p.heads = s.heads;
  p.dim = s.dim;
  p.norm = s.norm;
  p.weight = s.weight ? dw.as<float>() : nullptr;
  p.rope_dim = s.rope_dim;
  p.inv_freq = df.as<float>();
  p.pos0 = pos0;
  p.pos_step = pos_step;
  p.inverse = s.inverse;
  p.round = round;
  gpu::row_op(p, nullptr);
  sync();
  y->assign(size_t(rows) * s.dim, NAN);
  if (s.in_place) {
    const std::vector<float> all = to_host<float>(dx, x.size());
    for (int r = 0; r < rows; ++r) std::copy_n(&all[size_t(r) * stride], s.dim, &(*y)[size_t(r) * s.dim]);
  } else if (s.fp32_out) {
    *y = to_host<float>(dy, y->size());
  }
  *y_bf16 = to_host<uint16_t>(dyb, y->size());
}

void check_row(const RowShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  const int rows = s.tokens * s.heads, stride = s.dim + s.x_pad;
  const int64_t pos0 = 123457 + seed;  // large angles: the fp64 sin / cos argument reduction matters
  const int pos_step = 1;
  const std::vector<float> inv_freq = rope_freqs(s.rope_dim);
  const std::vector<float> x = random_vector(size_t(rows) * stride, rng, -3.0f, 3.0f);
  const std::vector<float> weight = random_vector(s.dim, rng, 0.5f, 1.5f);
  std::vector<float> want(size_t(rows) * s.dim);
  for (int r = 0; r < rows; ++r) {
    float* y = &want[size_t(r) * s.dim];
    std::copy_n(&x[size_t(r) * stride], s.dim, y);
    if (s.norm) cpu::rms_norm(y, s.weight ? weight.data() : nullptr, y, 1, s.dim, 1e-6f);
    if (s.rope_dim)
      cpu::rope_interleaved(y + s.dim - s.rope_dim, s.rope_dim, inv_freq.data(), pos0 + (r / s.heads) * pos_step,
                            s.inverse);
    host_round(y, s);
  }
  std::vector<float> got;
  std::vector<uint16_t> got_bf16;
  run_row_op(s, s.round, x, weight, inv_freq, pos0, pos_step, &got, &got_bf16);
  const int bad = count_mismatches(s.fp32_out ? got : bf16_values(got_bf16), want, s.fp32_out ? 1e-5 : 4e-3);
  // A last-bit difference (fp64 sum order, cos / sin) can move a value across a rounding boundary.
  EXPECT_LE(bad, s.round == gpu::RowRound::None ? 0 : int(want.size()) / 200)
      << bad << " of " << want.size() << " elements differ";
  int bad_bf16 = 0, bits = 0;
  if (s.fp32_out) {
    for (size_t i = 0; i < got.size(); ++i) bad_bf16 += got_bf16[i] != f32_to_bf16(got[i]);
    EXPECT_EQ(bad_bf16, 0) << "y_bf16 is not the bf16 of y";
    if (s.round != gpu::RowRound::None && s.round != gpu::RowRound::Bf16) {
      // The block rounding itself: src/formats on the kernel's own unrounded rows must give the same bits.
      std::vector<float> plain;
      std::vector<uint16_t> plain_bf16;
      run_row_op(s, gpu::RowRound::None, x, weight, inv_freq, pos0, pos_step, &plain, &plain_bf16);
      for (int r = 0; r < rows; ++r) host_round(&plain[size_t(r) * s.dim], s);
      bits = bits_differ(got, plain);
      EXPECT_EQ(bits, 0) << "FP8 / FP4 block rounding differs from src/formats";
    }
  }
  std::printf("[row_op] tokens=%d heads=%d dim=%d rope=%d norm=%d round=%d in_place=%d: %d/%zu differ from the CPU "
              "(max|diff| %.3g), %d rounding bits differ\n",
              s.tokens, s.heads, s.dim, s.rope_dim, int(s.norm), int(s.round), int(s.in_place), bad, want.size(),
              max_abs_diff(s.fp32_out ? got : bf16_values(got_bf16), want), bits);
}

TEST(OpsRowsRowOp, DecodeShapes) {
  DSV4_REQUIRE_CUDA();
  // kv norm + RoPE + FP8 (input a slice of the fused x-side projection)
  check_row({1, 1, 512, 64, true, true, gpu::RowRound::KvFp8, 4000}, 61);
  check_row({1, 1, 512, 64, true, true, gpu::RowRound::Bf16, 4000}, 62);
  check_row({1, 1, 512, 64, true, true, gpu::RowRound::None, 4000}, 63);
  // q_norm: one row of q_lora_rank 1024 with weight, bf16 output only (and with fp32 too)
  check_row({1, 1, 1024, 0, true, true, gpu::RowRound::None, 512, false, false}, 64);
  check_row({1, 1, 1024, 0, true, true, gpu::RowRound::None, 512}, 65);
  // q norm + RoPE over 64 heads of 512, in place
  check_row({1, 64, 512, 64, true, false, gpu::RowRound::None, 0, true}, 66);
  // indexer q: RoPE + Hadamard + FP4 over 64 heads of 128, in place
  check_row({1, 64, 128, 64, false, false, gpu::RowRound::IndexerFp4, 0, true}, 67);
}

TEST(OpsRowsRowOp, PrefillShapes) {
  DSV4_REQUIRE_CUDA();
  check_row({64, 1, 512, 64, true, true, gpu::RowRound::KvFp8, 4000}, 71);
  check_row({64, 64, 512, 64, true, false, gpu::RowRound::None, 0, true}, 72);
  check_row({64, 64, 128, 64, false, false, gpu::RowRound::IndexerFp4, 0, true}, 73);  // 4 warps per block
  check_row({64, 1, 1024, 0, true, true, gpu::RowRound::None, 512, false, false}, 74);
  // 4 rows per block: heads of one token per block (16 heads), or rows of two tokens in a block (6 heads)
  check_row({64, 16, 128, 64, false, false, gpu::RowRound::None, 0, true}, 75);
  check_row({200, 6, 128, 64, false, false, gpu::RowRound::None, 0, true}, 76);
}

TEST(OpsRowsRowOp, WideHadamardOddRowsAndInverse) {
  DSV4_REQUIRE_CUDA();
  check_row({2, 3, 256, 64, true, true, gpu::RowRound::IndexerFp4}, 81);   // stages across warps
  check_row({1, 1, 4096, 0, false, false, gpu::RowRound::IndexerFp4}, 82);  // 1024 threads
  check_row({1, 2, 32, 0, true, false, gpu::RowRound::IndexerFp4}, 83);    // 8 lanes per row
  check_row({5, 3, 37, 6, true, true, gpu::RowRound::None, 3}, 84);        // odd dim - rope_dim
  check_row({1, 1, 4091, 2, true, true, gpu::RowRound::Bf16, 1}, 85);      // odd, 1023 threads
  check_row({3, 2, 64, 0, true, true, gpu::RowRound::KvFp8}, 86);          // 16 lanes per row
  check_row({4, 2, 192, 64, true, false, gpu::RowRound::KvFp8, 0, false, true, true}, 87);  // inverse RoPE
  check_row({7, 1, 4096, 0, true, true, gpu::RowRound::None, 5}, 88);
}

// Compressor entry finishing in a captured decode graph: emit_ratio with the position on the device. Only the
// step that completes an entry writes it (in place, RoPE at entry · ratio); other steps leave everything alone.
// a and b in one row_op_pair launch, or each in its own row_op launch.
void run_row_ops(const gpu::RowOpParams& a, const gpu::RowOpParams& b, bool paired) {
  if (paired) {
    gpu::row_op_pair(a, b, nullptr);
  } else {
    gpu::row_op(a, nullptr);
    gpu::row_op(b, nullptr);
  }
  sync();
}

// row_op_pair runs two independent row ops in one launch (q_norm and the kv row of a decode step): each must
// give exactly the bits of its own row_op launch (padded lanes add zeros only).
void check_pair(int tokens, int dim_a, int dim_b, int rope_b, uint32_t seed) {
  SCOPED_TRACE("pair tokens " + std::to_string(tokens) + " dims " + std::to_string(dim_a) + "/" + std::to_string(dim_b));
  std::mt19937 rng(seed);
  const std::vector<float> xa = random_vector(size_t(tokens) * dim_a, rng, -3.0f, 3.0f);
  const std::vector<float> xb = random_vector(size_t(tokens) * dim_b, rng, -3.0f, 3.0f);
  const std::vector<float> wa = random_vector(dim_a, rng, 0.5f, 1.5f), wb = random_vector(dim_b, rng, 0.5f, 1.5f);
  const std::vector<float> inv_freq = rope_freqs(rope_b);
  DeviceBuffer dxa = to_device(xa), dxb = to_device(xb), dwa = to_device(wa), dwb = to_device(wb),
               df = to_device(inv_freq);
  auto outputs = [&](bool paired) {
    DeviceBuffer ya = bf16_nan_buffer(xa.size()), yb = nan_buffer(xb.size());
    gpu::RowOpParams a, b;
    a.x = dxa.as<float>(), a.x_token_stride = dim_a, a.y_bf16 = ya.as<uint16_t>();
    a.tokens = tokens, a.dim = dim_a, a.norm = true, a.weight = dwa.as<float>();
    b.x = dxb.as<float>(), b.x_token_stride = dim_b, b.y = yb.as<float>(), b.y_token_stride = dim_b;
    b.tokens = tokens, b.dim = dim_b, b.norm = true, b.weight = dwb.as<float>(), b.rope_dim = rope_b;
    b.inv_freq = df.as<float>(), b.pos0 = 8211, b.round = gpu::RowRound::KvFp8;
    run_row_ops(a, b, paired);
    return std::pair{to_host<uint16_t>(ya, xa.size()), to_host<float>(yb, xb.size())};
  };
  const auto [alone_a, alone_b] = outputs(false);
  const auto [pair_a, pair_b] = outputs(true);
  EXPECT_EQ(pair_a, alone_a);
  EXPECT_EQ(bits_differ(pair_b, alone_b), 0);
  for (float v : pair_b) ASSERT_FALSE(std::isnan(v)) << "an output of b was not written";
}

TEST(OpsRowsRowOp, PairMatchesTwoLaunches) {
  DSV4_REQUIRE_CUDA();
  check_pair(1, 1024, 512, 64, 81);   // Flash decode: q_norm (q_lora 1024) + kv (head 512, rope 64)
  check_pair(64, 1024, 512, 64, 82);  // a prefill chunk
  check_pair(3, 64, 128, 64, 83);     // tiny models: rows narrower than a warp
}

// The q pair of a decode step: q's per-head norm + RoPE beside the indexer's q RoPE + FP4 rounding, both in place
// in one buffer (token stride = both ops' heads), one launch; each must give the bits of its own row_op launch.
void check_q_pair(int tokens, int heads_a, int dim_a, int heads_b, int dim_b, int rope, uint32_t seed) {
  SCOPED_TRACE("q pair tokens " + std::to_string(tokens) + " heads " + std::to_string(heads_a) + " x " +
               std::to_string(dim_a) + " / " + std::to_string(heads_b) + " x " + std::to_string(dim_b));
  std::mt19937 rng(seed);
  const int stride = heads_a * dim_a + heads_b * dim_b;
  const std::vector<float> x = random_vector(size_t(tokens) * stride, rng, -3.0f, 3.0f);
  const std::vector<float> inv_freq = rope_freqs(rope);
  DeviceBuffer df = to_device(inv_freq);
  auto output = [&](bool paired) {
    DeviceBuffer dx = to_device(x);
    gpu::RowOpParams a, b;
    a.x = a.y = dx.as<float>();
    a.x_token_stride = a.y_token_stride = stride;
    a.x_head_stride = a.y_head_stride = dim_a;
    a.tokens = tokens, a.heads = heads_a, a.dim = dim_a, a.norm = true, a.eps = 1e-6f;
    a.rope_dim = rope, a.inv_freq = df.as<float>(), a.pos0 = 8211;
    b = a;
    b.x = b.y = dx.as<float>() + heads_a * dim_a;
    b.x_head_stride = b.y_head_stride = dim_b;
    b.heads = heads_b, b.dim = dim_b, b.norm = false, b.round = gpu::RowRound::IndexerFp4;
    run_row_ops(a, b, paired);
    return to_host<float>(dx, x.size());
  };
  const std::vector<float> alone = output(false), pair = output(true);
  EXPECT_EQ(bits_differ(pair, alone), 0);
  EXPECT_GT(bits_differ(pair, x), x.size() / 2) << "the ops changed too little: were they run?";
}

TEST(OpsRowsRowOp, QPairMatchesTwoLaunches) {
  DSV4_REQUIRE_CUDA();
  check_q_pair(1, 64, 512, 64, 128, 64, 91);  // Flash decode: 64 heads of 512 (128 lanes) + 64 indexer heads of 128
  check_q_pair(5, 64, 512, 64, 128, 64, 92);  // a batched decode step
  check_q_pair(2, 8, 64, 4, 32, 16, 93);      // tiny models: rows narrower than a warp
  check_q_pair(33, 64, 512, 64, 128, 64, 94);  // a prefill chunk: the indexer rows 4 per block
  check_q_pair(37, 64, 512, 3, 128, 64, 95);   // the narrower op's last block partly filled
}

void check_emit(int dim, int rope_dim, int ratio, gpu::RowRound round, uint32_t seed) {
  std::mt19937 rng(seed);
  const int entries = 8;
  const std::vector<float> inv_freq = rope_freqs(rope_dim);
  const std::vector<float> start = random_vector(size_t(entries) * dim, rng, -3.0f, 3.0f);
  const std::vector<float> weight = random_vector(dim, rng, 0.5f, 1.5f);
  DeviceBuffer dw = to_device(weight), df = to_device(inv_freq);
  for (const int64_t pos : {int64_t(5) * ratio + ratio - 1, int64_t(5) * ratio + ratio / 2}) {
    DeviceBuffer dx = to_device(start), dpos = to_device(std::vector<int64_t>{pos});
    gpu::RowOpParams p;
    p.x = p.y = dx.as<float>();
    p.x_token_stride = p.y_token_stride = dim;
    p.tokens = 1;
    p.dim = dim;
    p.norm = true;
    p.weight = dw.as<float>();
    p.rope_dim = rope_dim;
    p.inv_freq = df.as<float>();
    p.pos_step = ratio;
    p.round = round;
    p.pos_device = dpos.as<int64_t>();
    p.emit_ratio = ratio;
    gpu::row_op(p, nullptr);
    sync();
    const std::vector<float> got = to_host<float>(dx, start.size());
    std::vector<float> want = start;
    const bool completes = (pos + 1) % ratio == 0;
    if (completes) {
      const int64_t b = pos / ratio;
      float* y = &want[size_t(b) * dim];
      cpu::rms_norm(y, weight.data(), y, 1, dim, 1e-6f);
      cpu::rope_interleaved(y + dim - rope_dim, rope_dim, inv_freq.data(), b * ratio, false);
      RowShape s{1, 1, dim, rope_dim, true, true, round};
      host_round(y, s);
    }
    const int bad = count_mismatches(got, want, 1e-5);
    EXPECT_LE(bad, completes ? dim / 200 : 0) << "pos " << pos << ": " << bad << " elements differ";
    std::printf("[row_op emit] dim=%d ratio=%d pos=%lld (%s): %d/%zu differ\n", dim, ratio, (long long)pos,
                completes ? "completes entry" : "no entry", bad, want.size());
  }
}

TEST(OpsRowsRowOp, CompressorEntryEmit) {
  DSV4_REQUIRE_CUDA();
  check_emit(512, 64, 4, gpu::RowRound::KvFp8, 91);
  check_emit(512, 64, 128, gpu::RowRound::KvFp8, 92);
  check_emit(128, 64, 4, gpu::RowRound::IndexerFp4, 93);
}

// The MTP block's input norms (any dim: 64, 4096, Pro's 7168, an odd 1001) and its broadcast add.
TEST(OpsRowsMtpInput, RmsNormRowsAndAddToStreams) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(11);
  for (const int dim : {64, 1001, 4096, 7168})
    for (const bool gathered : {false, true}) {
      const int rows = 6, vocab = 9, ld = dim + 3;  // fp32 rows with a stride past dim
      const std::vector<float> weight = random_vector(size_t(dim), rng, 0.5f, 1.5f);
      std::vector<float> x(size_t(rows) * ld), dense(size_t(rows) * dim);
      std::vector<uint16_t> table(size_t(vocab) * dim);
      std::vector<int32_t> ids(static_cast<size_t>(rows));
      for (int r = 0; r < rows; ++r) {
        ids[size_t(r)] = (r * 5 + 2) % vocab;
        for (int i = 0; i < dim; ++i) x[size_t(r) * ld + i] = std::uniform_real_distribution<float>(-3, 3)(rng);
      }
      for (uint16_t& v : table) v = f32_to_bf16(std::uniform_real_distribution<float>(-2, 2)(rng));
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < dim; ++i)
          dense[size_t(r) * dim + i] =
              gathered ? bf16_to_f32(table[size_t(ids[size_t(r)]) * dim + i]) : x[size_t(r) * ld + i];
      std::vector<float> want(dense.size());
      cpu::rms_norm(dense.data(), weight.data(), want.data(), rows, dim, 1e-6f);
      const DeviceBuffer d_x = to_device(x), d_w = to_device(weight), d_table = to_device(table), d_ids = to_device(ids);
      DeviceBuffer d_y(dense.size() * sizeof(uint16_t));
      d_y.fill_bytes(0xff);
      gpu::RmsNormRowsParams p;
      if (gathered) {
        p.table = d_table.as<uint16_t>();
        p.ids = d_ids.as<int32_t>();
      } else {
        p.x = d_x.as<float>();
        p.ld = ld;
      }
      p.rows = rows;
      p.dim = dim;
      p.weight = d_w.as<float>();
      p.eps = 1e-6f;
      p.y_bf16 = d_y.as<uint16_t>();
      gpu::rms_norm_rows(p, nullptr);
      const std::vector<uint16_t> got = to_host<uint16_t>(d_y, dense.size());
      int exact = 0, bad = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const float g = bf16_to_f32(got[i]), w = want[i];
        exact += got[i] == f32_to_bf16(w);
        bad += !(std::fabs(g - w) <= std::ldexp(std::fabs(w), -7));  // one bf16 step either way
      }
      EXPECT_EQ(bad, 0) << "dim " << dim << (gathered ? " gathered" : " fp32 rows");
      EXPECT_GE(exact, int(0.99 * got.size())) << "dim " << dim;
    }
  const int n = 3, hc = 4, D = 1000;
  const std::vector<float> streams = random_vector(size_t(n) * hc * D, rng), e = random_vector(size_t(n) * D, rng);
  DeviceBuffer d_s = to_device(streams);
  const DeviceBuffer d_e = to_device(e);
  gpu::add_to_streams(d_s.as<float>(), d_e.as<float>(), n, hc, D, nullptr);
  const std::vector<float> got = to_host<float>(d_s, streams.size());
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < D; ++d) {
        const size_t i = (size_t(t) * hc + k) * D + d;
        ASSERT_EQ(got[i], streams[i] + e[size_t(t) * D + d]) << t << " " << k << " " << d;
      }
}

}  // namespace
}  // namespace dsv4
