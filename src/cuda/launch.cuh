// SPDX-License-Identifier: MIT
// Launches of the forward-pass kernels with programmatic dependent launch (PDL, sm_90+). A decode step is ~1100
// dependent kernels, most of them a few µs long, so the gap between one kernel's end and the next one's start
// is a large part of the step. Under PDL a kernel's blocks may be scheduled while its predecessor in the stream
// still runs; they must not touch anything the predecessor writes or reads before dependent_wait() returns.
//
// Contract for every kernel launched with gpu::launch:
//   allow_dependents();  // first: lets the next kernel of the stream start launching
//   ...loads of data no kernel of the step writes (weights), address arithmetic...
//   dependent_wait();    // before the first load of an activation / state and before the first store
// (a kernel that does nothing before the wait uses dependent_enter()). Both instructions are no-ops when the
// launch is not programmatic, so kernels stay correct under plain launches and in tests.
// Reads of anything an earlier kernel of the step wrote must be plain loads, never __ldg / ld.global.nc: a
// non-coherent load counts as invariant for the kernel's lifetime, so the compiler may hoist it above the wait
// (seen on the H200: a gemv refactor read stale activations in every model test while the unit tests, which have
// no predecessor kernel, passed). __ldg stays for weights and scales only.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <utility>

namespace dsv4::gpu {

bool dependent_launch();  // process-wide switch (ops.h: set_dependent_launch)

__device__ __forceinline__ void allow_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Returns once every kernel this one depends on has completed and its memory operations are visible.
__device__ __forceinline__ void dependent_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void dependent_enter() {
  allow_dependents();
  dependent_wait();
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic launch when dependent_launch() is on;
// `cluster_x` > 1 launches thread-block clusters of that many blocks along x.
template <typename... Params, typename... Args>
cudaError_t launch_ex(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, unsigned cluster_x,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attrs[2];
  unsigned n = 0;
  if (cluster_x > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = cluster_x;
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
  }
  if (dependent_launch()) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  config.attrs = attrs;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// The wait for the previous kernel, once, at the first of several places that may need it: kernels that issue
// weight loads before it call it before their first activation load and again before their first store.
struct WaitOnce {
  bool pending = true;
  __device__ __forceinline__ void operator()() {
    if (pending) {
      dependent_wait();
      pending = false;
    }
  }
};

// configure() once per kernel and device (function attributes belong to a device's context: a pipeline over
// several GPUs launches the same kernel on each). `Tag` keeps the settings of one kernel apart.
template <auto kKernel, int kTag, class Configure>
cudaError_t once_per_device(Configure configure) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> result[kMaxDevices];  // cudaError_t + 1; 0: not configured yet
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  if (device < 0 || device >= kMaxDevices) return configure();
  int r = result[device].load(std::memory_order_acquire);
  if (r == 0) {  // two threads may both configure: the call is idempotent
    r = int(configure()) + 1;
    result[device].store(r, std::memory_order_release);
  }
  return cudaError_t(r - 1);
}

// Raises kKernel's dynamic shared-memory limit to `bytes` on its first call on each device (every kernel above 48 KB
// goes through this). One static per kernel: a generic lambda taking kernels of one signature shares a single
// static, so it configured only the first kernel it saw and every other one failed its launch with
// cudaErrorInvalidValue (seen on the H100 with the copy-engine GEMVs at m > 8).
template <auto kKernel>
cudaError_t allow_dynamic_smem(int bytes) {
  return once_per_device<kKernel, 0>(
      [&] { return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
}

// Lets kKernel launch clusters above the portable 8 blocks (Hopper takes 16), once per device.
template <auto kKernel>
cudaError_t allow_nonportable_clusters() {
  return once_per_device<kKernel, 1>(
      [] { return cudaFuncSetAttribute(kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1); });
}

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                   Args&&... args) {
  return launch_ex(kernel, grid, block, smem, 1, stream, std::forward<Args>(args)...);
}

}  // namespace dsv4::gpu
