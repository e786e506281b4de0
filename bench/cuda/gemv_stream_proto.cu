// SPDX-License-Identifier: MIT
// dsv4_gemv_stream_proto: an experiment, not engine code. NVFP4 GEMV at m = 1 whose weights reach shared memory
// through the copy engine (cp.async.bulk into a ring of stages completed on mbarriers) instead of register loads,
// so that the bytes in flight per SM no longer depend on registers. One producer warp per block issues the bulk
// copies of whole 16-row tiles (one lane per weight or scale row, rows padded by 64 bytes against bank conflicts);
// eight consumer warps decode and multiply exactly like gemv.cu (same layout trick, same decoders, mma.sync bf16)
// and release the stage. Persistent grid: one or two blocks per SM walk tiles blockIdx.x, + gridDim.x, ...
// Checked against gemv() on the same data (bit-identical), timed against it and the copy kernel. Outcome
// (docs/perf.md, fifth round): slower than gemv() except on one expert's 2048x4096; kept as the starting point
// of the copy-engine GEMV, not used by the engine.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "bench_util.cuh"
#include "cuda/bandwidth.h"
#include "cuda/dequant.cuh"
#include "cuda/device.h"
#include "cuda/gemv.h"

namespace {

using namespace dsv4;
using bench::check, bench::fill, bench::time_steps;

constexpr int kRows = 16, kConsumers = 8, kThreads = (kConsumers + 1) * 32, kMaxStages = 8;
constexpr int kRowPad = 64, kScalePad = 16;
constexpr int kChunkBytes = 64;  // per row: 4 quad threads x 16 bytes = 128 fp4 values

struct Args {
  const uint8_t* w;      // [n, k/2] e2m1
  const uint8_t* scale;  // [n, k/16] e4m3
  const uint16_t* x;     // [k] bf16
  uint16_t* y;           // [n] bf16
  int n, k, stages;
  float y_factor;        // weight_scale_2 * kNvfp4OutputFactor
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void mma_bf16(float c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__global__ void __launch_bounds__(kThreads, 1) gemv_stream_kernel(Args a) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int row_bytes = a.k / 2, scale_bytes = a.k / 16;
  const int w_stride = row_bytes + kRowPad, s_stride = scale_bytes + kScalePad;
  const int stage_bytes = kRows * (w_stride + s_stride);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + a.stages * stage_bytes);
  uint64_t* empty = full + kMaxStages;
  __shared__ float red[2][kConsumers][kRows];  // by tile parity: one consumer barrier per tile
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n_tiles = (a.n + kRows - 1) / kRows;
  if (threadIdx.x == 0) {
    for (int s = 0; s < a.stages; ++s) {
      mbar_init(full + s, 1);
      mbar_init(empty + s, kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumers) {  // producer warp: lane r copies weight row r (lanes 0-15) or scale row r - 16
    int it = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, ++it) {
      const int s = it % a.stages;
      if (it >= a.stages) mbar_wait(empty + s, uint32_t((it / a.stages - 1) & 1));
      const int rows = min(kRows, a.n - tile * kRows);
      uint8_t* w_s = smem + s * stage_bytes;
      uint8_t* s_s = w_s + kRows * w_stride;
      if (lane == 0) mbar_expect_tx(full + s, uint32_t(rows * (row_bytes + scale_bytes)));
      __syncwarp();  // the transaction count is armed before any copy can complete
      const int r = lane & (kRows - 1);
      const size_t row = size_t(tile) * kRows + r;
      if (r < rows) {
        if (lane < kRows)
          bulk_copy(w_s + r * w_stride, a.w + row * row_bytes, uint32_t(row_bytes), full + s);
        else
          bulk_copy(s_s + r * s_stride, a.scale + row * scale_bytes, uint32_t(scale_bytes), full + s);
      }
    }
    return;
  }

  // Consumers: warp w takes chunks w, w + 8, ... of every tile (quad thread t: 16 bytes of rows g and g + 8).
  const int g = lane >> 2, t = lane & 3;
  const int n_chunks = row_bytes / kChunkBytes;
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(a.x);
  int it = 0;
  for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x, ++it) {
    const int s = it % a.stages;
    mbar_wait(full + s, uint32_t((it / a.stages) & 1));
    const uint8_t* w_s = smem + s * stage_bytes;
    const uint8_t* s_s = w_s + kRows * w_stride;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = warp; c < n_chunks; c += kConsumers) {
      const uint4 lo = *reinterpret_cast<const uint4*>(w_s + g * w_stride + c * kChunkBytes + t * 16);
      const uint4 hi = *reinterpret_cast<const uint4*>(w_s + (g + 8) * w_stride + c * kChunkBytes + t * 16);
      const int kk = c * 128 + t * 32;  // this thread's 32 elements
      const uint32_t sc_lo = *reinterpret_cast<const uint16_t*>(s_s + g * s_stride + kk / 16);
      const uint32_t sc_hi = *reinterpret_cast<const uint16_t*>(s_s + (g + 8) * s_stride + kk / 16);
      uint32_t wl[16], wh[16];
      const uint32_t lw[4] = {lo.x, lo.y, lo.z, lo.w}, hw[4] = {hi.x, hi.y, hi.z, hi.w};
      const uint32_t fl0 = dq::nvfp4_factor(sc_lo & 0xff), fl1 = dq::nvfp4_factor(sc_lo >> 8);
      const uint32_t fh0 = dq::nvfp4_factor(sc_hi & 0xff), fh1 = dq::nvfp4_factor(sc_hi >> 8);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        dq::e2m1x8_to_bf16x2(lw[i], i < 2 ? fl0 : fl1, wl + 4 * i);
        dq::e2m1x8_to_bf16x2(hw[i], i < 2 ? fh0 : fh1, wh + 4 * i);
      }
      uint32_t xb[16];
      if (g == 0) {  // batch column 0 only (m = 1)
        const uint4* xp = reinterpret_cast<const uint4*>(x + kk);
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          const uint4 q = __ldg(xp + v);
          xb[4 * v] = q.x, xb[4 * v + 1] = q.y, xb[4 * v + 2] = q.z, xb[4 * v + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) xb[i] = 0;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) mma_bf16(acc, wl[2 * i], wh[2 * i], wl[2 * i + 1], wh[2 * i + 1], xb[2 * i], xb[2 * i + 1]);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + s);  // this warp is done with the stage
    if (t == 0) {  // column 0: acc[0] row g, acc[2] row g + 8
      red[it & 1][warp][g] = acc[0];
      red[it & 1][warp][g + 8] = acc[2];
    }
    // One barrier: red[it & 1] is complete; red[(it + 1) & 1] was read before this barrier by the tile before.
    asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * 32));
    if (threadIdx.x < kRows) {
      const int row = tile * kRows + threadIdx.x;
      float sum = 0.0f;
      for (int w = 0; w < kConsumers; ++w) sum += red[it & 1][w][threadIdx.x];
      if (row < a.n) a.y[row] = __bfloat16_as_ushort(__float2bfloat16_rn(sum * a.y_factor));
    }
  }
}

float bf16f(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

int main() {
  if (!cuda_available()) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const DeviceInfo info = device_info(0);
  const double copy_bw = measure_copy_bandwidth_gbs() * 1e9;
  std::printf("device %s, %d SMs; copy kernel %.0f GB/s\n", info.name.c_str(), info.sm_count, copy_bw / 1e9);
  check(cudaFuncSetAttribute(gemv_stream_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 220 << 10), "smem attr");
  DeviceBuffer x(16384 * 2), y_ref(size_t(65536) * 2), y(size_t(65536) * 2);
  fill(x.data(), x.size(), 7, 0x807F807Fu, 0x3F003F00u);
  struct Shape { int n, k; };
  std::printf("%-12s %10s %10s %9s %9s %10s %8s\n", "shape", "gemv us", "stream us", "gemv frac", "strm frac",
              "max rel", "stages");
  for (const Shape sh : {Shape{4096, 8192}, Shape{32768, 1024}, Shape{4096, 4096}, Shape{2048, 4096},
                         Shape{8192, 1024}}) {
    const size_t wb = size_t(sh.n) * sh.k / 2, sb = size_t(sh.n) * sh.k / 16, set_bytes = wb + sb;
    const int sets = int(std::max<size_t>(2, (size_t(512) << 20) / set_bytes));
    DeviceBuffer w(wb * sets), s(sb * sets);
    fill(w.data(), w.size(), 11, ~0u, 0);
    fill(s.data(), s.size(), 13, 0x37373737u, 0x30303030u);  // e4m3 scales in [2^-1, ~2]
    const int row_bytes = sh.k / 2, scale_bytes = sh.k / 16;
    const int stage_bytes = kRows * (row_bytes + kRowPad + scale_bytes + kScalePad);
    // Two blocks per SM when two stages of each fit in half the shared memory (their tiles' reductions overlap).
    const int per_sm = 4 * stage_bytes <= (200 << 10) ? 2 : 1;
    const int stages = std::min(kMaxStages, int((200 << 10) / per_sm / stage_bytes));
    const size_t smem = size_t(stages) * stage_bytes + 2 * kMaxStages * sizeof(uint64_t);
    const int n_tiles = (sh.n + kRows - 1) / kRows, grid = std::min(n_tiles, per_sm * info.sm_count);
    auto run_stream = [&](cudaStream_t st, int set) {
      Args a{w.as<uint8_t>() + size_t(set) * wb, s.as<uint8_t>() + size_t(set) * sb, x.as<uint16_t>(),
             y.as<uint16_t>(), sh.n, sh.k, stages, 0.5f * dq::kNvfp4OutputFactor};
      gemv_stream_kernel<<<grid, kThreads, smem, st>>>(a);
    };
    auto run_gemv = [&](cudaStream_t st, int set) {
      GemvParams p;
      p.m = 1, p.n = sh.n, p.k = sh.k, p.x = x.data(), p.y = y_ref.data(), p.out = GemvOut::BF16;
      p.w = w.as<uint8_t>() + size_t(set) * wb, p.w_scale = s.as<uint8_t>() + size_t(set) * sb;
      p.weight = GemvWeight::NVFP4, p.w_scale_2 = 0.5f, p.stream = st;
      gemv(p);
    };
    if (stages < 2) {
      std::printf("%5dx%-6d  k too large for two stages\n", sh.n, sh.k);
      continue;
    }
    run_gemv(nullptr, 0);
    run_stream(nullptr, 0);
    check(cudaGetLastError(), "launch");
    check(cudaDeviceSynchronize(), "sync");
    std::vector<uint16_t> a_h(sh.n), b_h(sh.n);
    check(cudaMemcpy(a_h.data(), y_ref.data(), sh.n * 2, cudaMemcpyDeviceToHost), "copy");
    check(cudaMemcpy(b_h.data(), y.data(), sh.n * 2, cudaMemcpyDeviceToHost), "copy");
    double max_rel = 0, max_ref = 0;
    for (int i = 0; i < sh.n; ++i) max_ref = std::max(max_ref, double(std::fabs(bf16f(a_h[i]))));
    for (int i = 0; i < sh.n; ++i) max_rel = std::max(max_rel, std::fabs(double(bf16f(a_h[i])) - bf16f(b_h[i])) / max_ref);
    const int steps = std::max(20, sets);
    const double t_gemv = time_steps([&](cudaStream_t st, int i) { run_gemv(st, i % sets); }, steps);
    const double t_stream = time_steps([&](cudaStream_t st, int i) { run_stream(st, i % sets); }, steps);
    std::printf("%5dx%-6d %10.2f %10.2f %9.3f %9.3f %10.2e %5d x %d\n", sh.n, sh.k, t_gemv * 1e6, t_stream * 1e6,
                set_bytes / t_gemv / copy_bw, set_bytes / t_stream / copy_bw, max_rel, stages, per_sm);
  }
  return 0;
}
