// SPDX-License-Identifier: MIT
// Lets the byte-format headers compile both as plain C++ and inside CUDA kernels.
#pragma once
#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif
