// SPDX-License-Identifier: MIT
// cpu_linear_bench: the CPU backend's linear layers on V4-Flash shapes, fp32 weights (gemm_nt, BLAS) against packed
// weights (gemm_nt_packed: NVFP4, MXFP4, FP8 blocks, BF16 decoded a tile at a time), at decode (1 row) and prefill
// (64 / 256 rows) sizes. Prints the time per call, the weight bytes streamed per second and their fraction of this
// machine's copy bandwidth (a memcpy measured in the same run), and the speed against fp32. Each call takes the next
// of several copies of the weight, 1 GiB of fp32 copies in all, so that no weight is read from the caches (a decoded
// model's weights never are).
//   cpu_linear_bench [passes over the copies]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cpu/ops.h"
#include "formats/bf16.h"
#include "quant/stored_weight.h"

namespace {

using Clock = std::chrono::steady_clock;

// f(i) for i in [0, reps) after a warm-up call of each i < warm (page faults, thread pool).
template <class F>
double seconds_per_call(int reps, int warm, F&& f) {
  for (int i = 0; i < warm; ++i) f(i);
  const auto start = Clock::now();
  for (int i = 0; i < reps; ++i) f(i);
  return std::chrono::duration<double>(Clock::now() - start).count() / reps;
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t(1) << 30;
  std::vector<char> a(bytes, 1), b(bytes, 0);
  const double s = seconds_per_call(3, 1, [&](int) { std::memcpy(b.data(), a.data(), bytes); });
  return 2.0 * double(bytes) / s / 1e9;  // read + write
}

struct Format {
  const char* name;
  dsv4::WeightFormat format;
  double bytes_per_weight;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace dsv4;
  const int passes = argc > 1 ? std::atoi(argv[1]) : 2;
  const double copy = copy_bandwidth_gbs();
  std::printf("copy bandwidth (1 GiB memcpy, read + write): %.1f GB/s\n", copy);
  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"expert w1 [2048, 4096]", 2048, 4096}, {"wq_b [32768, 1024]", 32768, 1024},
                          {"wo_b [4096, 8192]", 4096, 8192}};
  const Format formats[] = {{"nvfp4", WeightFormat::Nvfp4, 0.5 + 1.0 / 16},
                            {"mxfp4", WeightFormat::Mxfp4, 0.5 + 1.0 / 32},
                            {"fp8", WeightFormat::Fp8Block, 1.0},
                            {"bf16", WeightFormat::Float, 2.0}};
  std::mt19937 rng(1);
  std::printf("%-24s %-6s %5s %11s %9s %10s %9s\n", "shape", "format", "rows", "ms / call", "GB/s", "of copy",
              "vs fp32");
  for (const Shape& s : shapes) {
    const size_t n_weights = size_t(s.n) * s.k;
    const int copies = int((size_t(1) << 30) / (n_weights * 4));
    const int reps = passes * copies;
    std::vector<std::vector<float>> w(static_cast<size_t>(copies));
    for (std::vector<float>& c : w) {
      c.resize(n_weights);
      for (float& v : c) v = std::uniform_real_distribution<float>(-0.02f, 0.02f)(rng);
    }
    // Random codes (every byte a finite value in each format) with mid-range scales, `copies` of each.
    struct Codes {
      std::vector<std::vector<uint8_t>> w, scale;
    };
    std::vector<Codes> codes(std::size(formats));
    for (size_t fi = 0; fi < std::size(formats); ++fi) {
      const WeightFormat f = formats[fi].format;
      const size_t w_bytes = size_t(double(n_weights) * (f == WeightFormat::Float      ? 2.0
                                                         : f == WeightFormat::Fp8Block ? 1.0
                                                                                       : 0.5));
      const size_t scale_bytes = f == WeightFormat::Nvfp4      ? n_weights / 16
                                 : f == WeightFormat::Mxfp4    ? n_weights / 32
                                 : f == WeightFormat::Fp8Block ? size_t((s.n + 127) / 128) * ((s.k + 127) / 128)
                                                               : 0;
      for (int c = 0; c < copies; ++c) {
        std::vector<uint8_t> b(w_bytes);
        for (uint8_t& v : b) v = uint8_t(rng() & 0x77);
        codes[fi].w.push_back(std::move(b));
        codes[fi].scale.emplace_back(scale_bytes, f == WeightFormat::Nvfp4 ? 0x30 : 120);
      }
    }
    for (int M : {1, 4, 64, 256}) {
      std::vector<float> x(size_t(M) * s.k, 0.5f), y(size_t(M) * s.n);
      const int warm = M <= 4 ? copies : 1;
      const int calls = M <= 4 ? reps : std::max(2, reps / 8);
      const double fp32 = seconds_per_call(calls, warm, [&](int i) {
        cpu::gemm_nt(x.data(), w[size_t(i % copies)].data(), y.data(), M, s.n, s.k);
      });
      const double fp32_bytes = double(n_weights) * 4;
      std::printf("%-24s %-6s %5d %11.3f %9.1f %10.3f %9s\n", s.name, "fp32", M, fp32 * 1e3, fp32_bytes / fp32 / 1e9,
                  fp32_bytes / fp32 / 1e9 / copy, "1.00");
      for (size_t fi = 0; fi < std::size(formats); ++fi) {
        const Format& f = formats[fi];
        const double t = seconds_per_call(calls, warm, [&](int i) {
          PackedWeight p;
          p.format = f.format;
          p.w = codes[fi].w[size_t(i % copies)].data();
          p.w_bytes = codes[fi].w[size_t(i % copies)].size();
          p.scale = codes[fi].scale[size_t(i % copies)].empty() ? nullptr : codes[fi].scale[size_t(i % copies)].data();
          p.scale_bytes = codes[fi].scale[size_t(i % copies)].size();
          p.scale_2 = 0.5f;
          cpu::gemm_nt_packed(x.data(), s.k, p, 0, y.data(), s.n, M, s.n, s.k);
        });
        const double bytes = double(n_weights) * f.bytes_per_weight;
        std::printf("%-24s %-6s %5d %11.3f %9.1f %10.3f %9.2f\n", s.name, f.name, M, t * 1e3, bytes / t / 1e9,
                    bytes / t / 1e9 / copy, fp32 / t);
      }
    }
  }
  return 0;
}
