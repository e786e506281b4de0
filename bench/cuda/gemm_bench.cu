// SPDX-License-Identifier: MIT
// dsv4_gemm_bench: the prefill GEMM (gemm.h) at m = 1024 / 4096 / 8192 on DeepSeek-V4-Flash linear shapes, for bf16
// weights (cuBLASLt alone) and fp8 / nvfp4 weights (decode to the bf16 scratch + cuBLASLt), with the decode timed
// alone too, and gemv()'s tiled tensor-core kernel (weights decoded in registers, no scratch) on the same data.
// Prints TFLOP/s (2 m n k / time) and the fraction of 790 TFLOP/s, the dense bf16 peak that 8192^3 products reach
// on the H200 (device docs). Each timing is the median of 7 runs of 10 back-to-back calls.
// Usage: dsv4_gemm_bench   (needs a GPU)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <vector>

#include "cuda/device.h"
#include "cuda/gemm.h"
#include "cuda/gemv.h"
#include "cuda/gemv_launch.h"

namespace {

using namespace dsv4;

constexpr double kPeakTflops = 790.0;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error %s in %s\n", cudaGetErrorName(e), what);
    std::exit(1);
  }
}

__global__ void fill_words(uint32_t* p, size_t n_words, uint32_t seed, uint32_t and_mask, uint32_t or_mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_words; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    p[i] = (uint32_t(z ^ (z >> 31)) & and_mask) | or_mask;
  }
}

void fill(const DeviceBuffer& b, uint32_t seed, uint32_t and_mask, uint32_t or_mask) {
  fill_words<<<1024, 256>>>(b.as<uint32_t>(), b.size() / 4, seed, and_mask, or_mask);
  check(cudaGetLastError(), "fill_words");
}

// Median seconds per call of `call` (10 back-to-back calls per sample, 7 samples, after 3 warm-up calls).
double time_call(const std::function<void(cudaStream_t)>& call, cudaStream_t s) {
  cudaEvent_t a, b;
  check(cudaEventCreate(&a), "event");
  check(cudaEventCreate(&b), "event");
  for (int i = 0; i < 3; ++i) call(s);
  std::vector<float> ms;
  for (int r = 0; r < 7; ++r) {
    check(cudaEventRecord(a, s), "record");
    for (int i = 0; i < 10; ++i) call(s);
    check(cudaEventRecord(b, s), "record");
    check(cudaEventSynchronize(b), "sync");
    float v = 0;
    check(cudaEventElapsedTime(&v, a, b), "elapsed");
    ms.push_back(v);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return double(ms[ms.size() / 2]) * 1e-3 / 10;
}

struct Shape {
  const char* name;
  int n, k;
};

struct Format {
  const char* name;
  GemvWeight w;
};

}  // namespace

int main() try {
  if (!cuda_available()) {
    std::fprintf(stderr, "dsv4_gemm_bench: no CUDA device\n");
    return 1;
  }
  const DeviceInfo info = device_info(0);
  std::printf("device: %s, %d SMs\n", info.name.c_str(), info.sm_count);
  const Shape shapes[] = {{"wide (32768x1024)", 32768, 1024},
                          {"deep (4096x8192)", 4096, 8192},
                          {"1024x4096", 1024, 4096},
                          {"2048x4096", 2048, 4096}};
  const Format formats[] = {{"bf16", GemvWeight::BF16}, {"fp8_block", GemvWeight::FP8_BLOCK},
                            {"nvfp4", GemvWeight::NVFP4}};
  const int ms[] = {128, 512, 1024, 4096, 8192};
  size_t max_nk = 0, max_mk = 0, max_mn = 0;
  for (const Shape& sh : shapes) {
    max_nk = std::max(max_nk, size_t(sh.n) * sh.k);
    max_mk = std::max(max_mk, size_t(8192) * sh.k);
    max_mn = std::max(max_mn, size_t(8192) * sh.n);
  }
  GemmContext ctx(max_nk);
  DeviceBuffer x(max_mk * 2), y(max_mn * 2), w(max_nk * 2), scale(max_nk / 8 + 4096), decoded(max_nk * 2);
  fill(x, 7, 0x807F807Fu, 0x3F003F00u);  // bf16 in +-[0.5, 1)
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");

  // wgmma: the fp4 wgmma kernel's block shapes (weight rows x activation rows; ws: warp-specialised), the engine's
  // choice first.
  std::printf("%-10s %-18s %6s %10s %9s %7s %12s | %-10s %9s %7s | %-12s %9s | %-10s %9s %7s | %-9s %-9s %-9s %-9s "
              "%-9s\n",
              "format", "shape", "m", "time (us)", "TFLOP/s", "of peak", "decode (us)", "tiled (us)", "TFLOP/s",
              "of peak", "tiled 1 (us)", "TFLOP/s", "wgmma (us)", "TFLOP/s", "of peak", "256x64", "128x128",
              "256x128", "ws256x128", "ws256x64");
  for (const Format& f : formats) {
    // Valid codes: bf16 in +-[0.5, 1), e4m3 without NaN, any e2m1; scales 2^0 (e8m0 127) / e4m3 1.0 (0x38).
    fill(w, 3, f.w == GemvWeight::BF16 ? 0x807F807Fu : f.w == GemvWeight::FP8_BLOCK ? 0xBFBFBFBFu : ~0u,
         f.w == GemvWeight::BF16 ? 0x3F003F00u : 0);
    check(cudaMemset(scale.data(), f.w == GemvWeight::NVFP4 ? 0x38 : 127, scale.size()), "memset");
    for (const Shape& sh : shapes) {
      WeightDesc wd;
      wd.n = sh.n, wd.k = sh.k, wd.weight = f.w, wd.w = w.data();
      wd.w_scale = f.w == GemvWeight::BF16 ? nullptr : scale.data();
      const double t_decode =
          f.w == GemvWeight::BF16
              ? 0.0
              : time_call([&](cudaStream_t st) { dequantize_weight_bf16(wd, decoded.as<uint16_t>(), st); }, s);
      for (const int m : ms) {
        GemmParams p;
        p.m = m, p.n = sh.n, p.k = sh.k, p.x = x.data(), p.weight = f.w, p.w = w.data(), p.w_scale = wd.w_scale;
        p.w_scale_2 = 0.5f, p.y = y.data(), p.out = GemvOut::BF16, p.stream = s;
        const double t = time_call([&](cudaStream_t) { ctx.gemm(p); }, s);
        const double tflops = 2.0 * m * sh.n * sh.k / t * 1e-12;
        GemvParams g;
        g.m = m, g.n = sh.n, g.k = sh.k, g.x = x.data(), g.w = w.data(), g.w_scale = wd.w_scale, g.w_scale_2 = 0.5f;
        g.y = y.data(), g.weight = f.w, g.out = GemvOut::BF16;
        set_gemv_wgmma(false);  // the mma.sync kernel's two variants, then (fp4) the wgmma kernel
        detail::tiled_weight_tiles = 2;
        const double t_tiled = time_call([&](cudaStream_t st) { g.stream = st; gemv(g); }, s);
        const double tiled_tflops = 2.0 * m * sh.n * sh.k / t_tiled * 1e-12;
        detail::tiled_weight_tiles = 1;  // the variant with one 16-row weight tile per warp, two blocks per SM
        const double t_tiled1 = time_call([&](cudaStream_t st) { g.stream = st; gemv(g); }, s);
        detail::tiled_weight_tiles = 0;
        set_gemv_wgmma(true);
        const bool fp4 = f.w == GemvWeight::NVFP4 && gemv_wgmma_enabled();
        auto time_wgmma = [&](int shape) {
          detail::wgmma_shape = shape;
          const double t_shape = fp4 ? time_call([&](cudaStream_t st) { g.stream = st; gemv(g); }, s) : 0.0;
          detail::wgmma_shape = 0;
          return t_shape;
        };
        const double t_wgmma = time_wgmma(0), t_shape1 = time_wgmma(1), t_shape2 = time_wgmma(2);
        const double t_shape3 = time_wgmma(3), t_shape4 = time_wgmma(4), t_shape5 = time_wgmma(5);
        const double wgmma_tflops = fp4 ? 2.0 * m * sh.n * sh.k / t_wgmma * 1e-12 : 0.0;
        std::printf("%-10s %-18s %6d %10.1f %9.1f %6.1f%% %12.1f | %10.1f %9.1f %6.1f%% | %12.1f %9.1f | %10.1f %9.1f "
                    "%6.1f%% | %9.1f %9.1f %9.1f %9.1f %9.1f\n",
                    f.name, sh.name, m, t * 1e6, tflops, 100.0 * tflops / kPeakTflops, t_decode * 1e6,
                    t_tiled * 1e6, tiled_tflops, 100.0 * tiled_tflops / kPeakTflops, t_tiled1 * 1e6,
                    2.0 * m * sh.n * sh.k / t_tiled1 * 1e-12, t_wgmma * 1e6, wgmma_tflops,
                    100.0 * wgmma_tflops / kPeakTflops, t_shape1 * 1e6, t_shape2 * 1e6, t_shape3 * 1e6, t_shape4 * 1e6,
                    t_shape5 * 1e6);
      }
    }
  }
  check(cudaStreamSynchronize(s), "sync");
  cudaStreamDestroy(s);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "dsv4_gemm_bench: %s\n", e.what());
  return 1;
}
