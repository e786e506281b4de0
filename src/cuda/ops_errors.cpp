// SPDX-License-Identifier: MIT
// Error reporting for the ops_*.cu launchers, compiled as plain C++ (fmt's consteval format strings do not
// compile under nvcc).
#include <cuda_runtime.h>

#include <string>

#include "core/check.h"

namespace dsv4::gpu::detail {

void throw_error(const char* message) { throw Error(message); }

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw Error(fmt::format("CUDA error {} ({}) launching {}", cudaGetErrorName(err), cudaGetErrorString(err), kernel));
}

}  // namespace dsv4::gpu::detail
