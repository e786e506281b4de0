// SPDX-License-Identifier: MIT
#include <atomic>
#include <cstdlib>
#include <string_view>

#include "core/env.h"
#include "cuda/launch.cuh"
#include "cuda/ops.h"
#include "cuda/switches.h"
#include "spdlog/spdlog.h"

namespace dsv4::gpu {
namespace {
std::atomic<bool> g_dependent_launch{true};
std::atomic<int> g_early_weights{-1};  // -1: not yet read from the environment
std::atomic<int> g_linear_f32_tiles{-1};  // likewise
}  // namespace

int read_once(std::atomic<int>& state, const char* env, int off, int on, const char* what, bool on_by_default) {
  int v = state.load(std::memory_order_relaxed);
  if (v < 0) {
    v = env_switch(env).value_or(on_by_default) ? on : off;
    if ((v == on) != on_by_default) spdlog::info("{} ({})", what, env);
    state.store(v, std::memory_order_relaxed);
  }
  return v;
}

bool dependent_launch() { return g_dependent_launch.load(std::memory_order_relaxed); }
void set_dependent_launch(bool on) { g_dependent_launch.store(on, std::memory_order_relaxed); }

EarlyWeights early_weights() {
  int v = g_early_weights.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("DSV4_EARLY_WEIGHTS");
    const std::string_view e = env ? env : "";
    v = int(e == "0" ? EarlyWeights::Off : e == "gemv" ? EarlyWeights::Gemv : e == "all" ? EarlyWeights::All
                                                                                     : kEarlyWeightsDefault);
    g_early_weights.store(v, std::memory_order_relaxed);
  }
  return EarlyWeights(v);
}
void set_early_weights(EarlyWeights mode) { g_early_weights.store(int(mode), std::memory_order_relaxed); }

bool linear_f32_tiles() {
  return read_once(g_linear_f32_tiles, "DSV4_LINEAR_F32_TILES", 0, 1,
                   "linear_f32: prefill-sized calls on the 4-row blocks", true) == 1;
}
void set_linear_f32_tiles(bool on) { g_linear_f32_tiles.store(on ? 1 : 0, std::memory_order_relaxed); }

}  // namespace dsv4::gpu
