// SPDX-License-Identifier: MIT
// Helpers shared by the GPU tests: host <-> device copies, poisoned outputs, random inputs, mismatch counts.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
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

// The gap between a row's two largest logits (a greedy pick closer than this to a tie may flip on rounding).
inline double top2_margin(const float* v, int n) {
  std::vector<float> s(v, v + n);
  std::partial_sort(s.begin(), s.begin() + 2, s.end(), std::greater<float>());
  return double(s[0]) - s[1];
}

// Logit differences, per row (one row = one position's logits over the vocabulary).
struct Diff {
  double max_abs = 0, max_ref = 0;
  std::vector<double> row_max;  // max |diff| of each row
  void add(const std::vector<float>& got, const std::vector<float>& want, int V) {
    EXPECT_EQ(got.size(), want.size());
    for (size_t r = 0; r * V < std::min(got.size(), want.size()); ++r) {
      double row = 0;
      for (size_t i = r * V; i < (r + 1) * V; ++i) {
        const double d = std::fabs(double(got[i]) - want[i]);
        row = std::isnan(d) ? INFINITY : std::max(row, d);
        max_ref = std::max(max_ref, std::fabs(double(want[i])));
      }
      row_max.push_back(row);
      max_abs = std::max(max_abs, row);
    }
  }
  double quantile(double q) const {
    std::vector<double> v = row_max;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[std::min(v.size() - 1, size_t(q * v.size()))];
  }
  double fraction_within(double tol) const {
    size_t ok = 0;
    for (double d : row_max) ok += d <= tol;
    return row_max.empty() ? 1 : double(ok) / row_max.size();
  }
};

}  // namespace dsv4::cuda_test
