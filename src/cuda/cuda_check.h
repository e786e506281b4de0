// SPDX-License-Identifier: MIT
// DSV4_CUDA_CHECK(expr): evaluate a CUDA runtime call and throw dsv4::Error naming the error and the call
// when it fails. Host code only (it pulls in fmt through core/check.h).
#pragma once
#include <cuda_runtime.h>

#include "core/check.h"

#define DSV4_CUDA_CHECK(expr)                                                                  \
  do {                                                                                         \
    const cudaError_t dsv4_cuda_err_ = (expr);                                                 \
    if (dsv4_cuda_err_ != cudaSuccess)                                                         \
      ::dsv4::fail(__FILE__, __LINE__,                                                         \
                   fmt::format("CUDA error {} ({}) from {}", cudaGetErrorName(dsv4_cuda_err_), \
                               cudaGetErrorString(dsv4_cuda_err_), #expr));                    \
  } while (0)
