// SPDX-License-Identifier: MIT
// Switches read from the environment (DSV4_DEVICE_DRAW=1, DSV4_OVERLAP=0, ...).
#pragma once
#include <cstdlib>
#include <optional>
#include <string_view>

namespace dsv4 {

// The variable's value when it is "0" or "1"; nothing when it is unset or holds anything else.
inline std::optional<bool> env_switch(const char* name) {
  const char* value = std::getenv(name);
  if (!value) return std::nullopt;
  const std::string_view v(value);
  if (v == "0" || v == "1") return v == "1";
  return std::nullopt;
}

}  // namespace dsv4
