// SPDX-License-Identifier: MIT
// One error type for the whole engine. Host code throws dsv4::Error through DSV4_CHECK with a message
// that names the object and, where possible, the fix; the CLI catches it, prints it and exits non-zero.
#pragma once
#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dsv4 {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const char* file, int line, const std::string& msg) {
  throw Error(fmt::format("{} ({}:{})", msg, file, line));
}

}  // namespace dsv4

// DSV4_CHECK(cond, "fmt {}", args...): throw dsv4::Error with the formatted message when cond is false.
#define DSV4_CHECK(cond, ...)                                              \
  do {                                                                     \
    if (!(cond)) ::dsv4::fail(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define DSV4_FAIL(...) ::dsv4::fail(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
