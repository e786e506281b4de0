// SPDX-License-Identifier: MIT
// Helpers shared by the CUDA benchmarks of bench/cuda: error exit, random device words, graph-replay timing.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace dsv4::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error %s in %s\n", cudaGetErrorName(e), what);
    std::exit(1);
  }
}

static __device__ uint32_t hash32(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9E3779B97F4A7C15ull + seed;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return uint32_t(z ^ (z >> 31));
}

// Random words; and_mask/or_mask shape them into valid codes (no NaN e4m3, bf16 in +-[0.5, 1), ...).
static __global__ void fill_words(uint32_t* p, size_t n_words, uint32_t seed, uint32_t and_mask, uint32_t or_mask) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_words; i += size_t(gridDim.x) * blockDim.x)
    p[i] = (hash32(i, seed) & and_mask) | or_mask;
}

inline void fill(void* p, size_t bytes, uint32_t seed, uint32_t and_mask, uint32_t or_mask) {
  fill_words<<<1024, 256>>>(static_cast<uint32_t*>(p), bytes / 4, seed, and_mask, or_mask);
  check(cudaGetLastError(), "fill_words");
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { check(cudaEventCreate(&a), "event"), check(cudaEventCreate(&b), "event"); }
  ~Timer() { cudaEventDestroy(a), cudaEventDestroy(b); }
};

// Captures `steps` calls of enqueue(stream, step) into a graph; returns the median replay time / steps (seconds).
inline double time_steps(const std::function<void(cudaStream_t, int)>& enqueue, int steps) {
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaGraph_t graph;
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "capture");
  for (int i = 0; i < steps; ++i) enqueue(s, i);
  check(cudaStreamEndCapture(s, &graph), "end capture");
  cudaGraphExec_t exec;
  check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  Timer t;
  for (int i = 0; i < 2; ++i) check(cudaGraphLaunch(exec, s), "graph launch");
  std::vector<float> ms;
  for (int r = 0; r < 15; ++r) {
    check(cudaEventRecord(t.a, s), "record");
    check(cudaGraphLaunch(exec, s), "graph launch");
    check(cudaEventRecord(t.b, s), "record");
    check(cudaEventSynchronize(t.b), "sync");
    float v = 0;
    check(cudaEventElapsedTime(&v, t.a, t.b), "elapsed");
    ms.push_back(v);
  }
  std::sort(ms.begin(), ms.end());
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  return double(ms[ms.size() / 2]) * 1e-3 / steps;
}

}  // namespace dsv4::bench
