// SPDX-License-Identifier: MIT
#include <atomic>

#include "cuda/launch.cuh"
#include "cuda/ops.h"

namespace dsv4::gpu {
namespace {
std::atomic<bool> g_dependent_launch{true};
}

bool dependent_launch() { return g_dependent_launch.load(std::memory_order_relaxed); }
void set_dependent_launch(bool on) { g_dependent_launch.store(on, std::memory_order_relaxed); }

}  // namespace dsv4::gpu
