// SPDX-License-Identifier: MIT
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "cuda/bandwidth.h"
#include "cuda/device.h"
#include "cuda/ops_common.cuh"

namespace dsv4 {
namespace {

// Four independent 16-byte loads in flight per thread and step, then a tail loop (also timed by
// bench/cuda/gemv_bench.cu, whose numbers docs/perf.md quotes).
__global__ void copy_uint4(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a, dst[i + stride] = b, dst[i + 2 * stride] = c, dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

__global__ void delay_kernel(uint64_t ns) {
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < ns);
}

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  char message[256];
  std::snprintf(message, sizeof message, "CUDA error %s (%s) from %s", cudaGetErrorName(err), cudaGetErrorString(err),
                what);
  gpu::detail::throw_error(message);
}

// Destroys the events however the measurement ends.
struct EventPair {
  cudaEvent_t start = nullptr, stop = nullptr;
  EventPair() {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~EventPair() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }
};

}  // namespace

void launch_copy_kernel(const void* src, void* dst, size_t bytes, cudaStream_t stream) {
  OPS_CHECK(bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) % 16 == 0,
            "launch_copy_kernel: %zu bytes and both pointers must be 16-byte multiples", bytes);
  copy_uint4<<<current_sm_count() * 8, 256, 0, stream>>>(static_cast<const uint4*>(src), static_cast<uint4*>(dst),
                                                         bytes / 16);
  DSV4_CUDA_LAUNCHED();
}

void launch_delay_kernel(double microseconds, cudaStream_t stream) {
  delay_kernel<<<1, 1, 0, stream>>>(uint64_t(microseconds * 1e3));
  DSV4_CUDA_LAUNCHED();
}

double measure_copy_bandwidth_gbs(size_t bytes, int reps) {
  OPS_CHECK(bytes >= 16 && reps > 0, "measure_copy_bandwidth_gbs: bytes %zu, reps %d", bytes, reps);
  const size_t n = bytes / sizeof(uint4);
  DeviceBuffer src(n * sizeof(uint4)), dst(n * sizeof(uint4));
  src.fill_bytes(0x3c);  // any value; the pages must exist before timing
  dst.fill_bytes(0);
  auto launch = [&] { launch_copy_kernel(src.data(), dst.data(), n * sizeof(uint4), nullptr); };
  // Warm-up: ~0.3 s of copies at H200 speed (4 TB/s), so the clocks are up before timing.
  const double warmup_copies = 0.3 * 4e12 / (2.0 * double(n * sizeof(uint4)));
  for (int i = 0; i < 2 * reps || i < warmup_copies; ++i) launch();
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (copy warm-up)");
  EventPair events;
  check(cudaEventRecord(events.start), "cudaEventRecord");
  for (int i = 0; i < reps; ++i) launch();
  check(cudaEventRecord(events.stop), "cudaEventRecord");
  check(cudaEventSynchronize(events.stop), "cudaEventSynchronize (copy)");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, events.start, events.stop), "cudaEventElapsedTime");
  const double seconds_per_copy = double(ms) * 1e-3 / reps;
  return 2.0 * double(n * sizeof(uint4)) / seconds_per_copy / 1e9;  // read + write
}

}  // namespace dsv4
