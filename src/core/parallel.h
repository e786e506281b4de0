// SPDX-License-Identifier: MIT
// Independent per-row work of the host spread over OpenMP threads, with each row's failure kept apart.
#pragma once
#include <exception>
#include <string>
#include <vector>

namespace dsv4 {

// f(i) for every i in [0, n), one index at a time per OpenMP thread (no threads for n = 1, nor when the caller says
// the rows are too small to be worth waking threads for: their spinning afterwards slows OpenBLAS's own threads);
// returns what each call threw, empty where it returned, so a caller decides per row.
template <class F>
std::vector<std::string> parallel_indices(int n, F&& f, bool worth_threads = true) {
  std::vector<std::string> failed(size_t(n > 0 ? n : 0));
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && worth_threads)
  for (int i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (const std::exception& e) {
      failed[size_t(i)] = e.what();
    }
  }
  return failed;
}

}  // namespace dsv4
