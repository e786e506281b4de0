// SPDX-License-Identifier: MIT
// Process-wide switches of the staged kernel forms (launch.cpp, gemv.cpp), each read from the environment once.
#pragma once
#include <atomic>

namespace dsv4::gpu {

// A staged form's switch: its value, read from `env` (0 / 1 -> `off` / `on`; unset -> `on` when `on_by_default`)
// at the first call (state < 0), and `what` logged when it is not the default. Setters store into `state`.
int read_once(std::atomic<int>& state, const char* env, int off, int on, const char* what, bool on_by_default = false);

}  // namespace dsv4::gpu
