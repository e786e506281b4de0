// SPDX-License-Identifier: MIT
// Helpers shared by the GPU tests: host <-> device copies, poisoned outputs, random inputs, mismatch counts.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cuda/device.h"

#define DSV4_REQUIRE_CUDA() \
  if (!::dsv4::cuda_available()) GTEST_SKIP() << "no CUDA driver or device"

namespace dsv4::cuda_test {

template <typename T>
DeviceBuffer to_device(const std::vector<T>& v) {
  DeviceBuffer b(std::max<size_t>(v.size(), 1) * sizeof(T));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& b, size_t n) {
  std::vector<T> v(n);
  b.download(v.data(), n * sizeof(T));
  return v;
}

inline DeviceBuffer nan_buffer(size_t floats) {
  DeviceBuffer b(std::max<size_t>(floats, 1) * sizeof(float));
  b.fill_bytes(0xff);  // NaN in every float: an element the kernel does not write fails the comparison
  return b;
}

inline std::vector<float> random_vector(size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Elements whose |got - want| exceeds rel·max(1, |want|); NaN counts.
inline int count_mismatches(const std::vector<float>& got, const std::vector<float>& want, double rel) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(got[i]) - want[i]);
    if (!(d <= rel * std::max(1.0, std::fabs(double(want[i]))))) ++bad;
  }
  return bad;
}

inline void sync() { ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

}  // namespace dsv4::cuda_test
