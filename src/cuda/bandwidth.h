// SPDX-License-Identifier: MIT
// The device's copy bandwidth, as the roofline of memory-bound kernels: a grid-stride 16-byte copy kernel (the
// ceiling for kernels that read with ordinary loads; cudaMemcpy D2D measured lower on H200, docs/perf.md).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace dsv4 {

// GB/s (1e9 bytes) counting bytes read + written, copying `bytes` from one device buffer to another: warm-up
// copies first (the card idles at low clocks), then the mean of `reps` copies timed with CUDA events. Allocates
// 2 x bytes of device memory for the duration of the call. Throws dsv4::Error on any CUDA failure.
double measure_copy_bandwidth_gbs(size_t bytes = size_t(2) << 30, int reps = 10);

// The copy kernel itself, for benchmarks that time it their own way (bench/cuda/gemv_bench.cu): copies `bytes`
// (a multiple of 16; both pointers 16-byte aligned) from src to dst on `stream` with sm_count x 8 blocks.
void launch_copy_kernel(const void* src, void* dst, size_t bytes, cudaStream_t stream);

// One thread that spins for `microseconds` of GPU time (%globaltimer): holds a stream back while the host
// queues work behind it, so event timings of that work do not include host launch time.
void launch_delay_kernel(double microseconds, cudaStream_t stream);

}  // namespace dsv4
