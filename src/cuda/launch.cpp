// SPDX-License-Identifier: MIT
#include <atomic>

#include "core/env.h"
#include "cuda/launch.cuh"
#include "cuda/ops.h"

namespace dsv4::gpu {
namespace {
std::atomic<bool> g_dependent_launch{true};
std::atomic<int> g_early_weights{-1};  // -1: not yet read from the environment
}

bool dependent_launch() { return g_dependent_launch.load(std::memory_order_relaxed); }
void set_dependent_launch(bool on) { g_dependent_launch.store(on, std::memory_order_relaxed); }

bool early_weights() {
  int v = g_early_weights.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_switch("DSV4_EARLY_WEIGHTS").value_or(kEarlyWeightsDefault) ? 1 : 0;
    g_early_weights.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}
void set_early_weights(bool on) { g_early_weights.store(on ? 1 : 0, std::memory_order_relaxed); }

}  // namespace dsv4::gpu
