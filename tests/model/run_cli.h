// SPDX-License-Identifier: MIT
// Runs the dsv4 binary under test (DSV4_BINARY) with arguments, capturing stdout + stderr and the exit code.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace dsv4::testing {

struct RunResult {
  int exit_code;
  std::string out;
};

inline RunResult run_dsv4(const std::string& args) {
  const std::string cmd = std::string(DSV4_BINARY) + " " + args + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  const int status = pclose(pipe);
  return {WEXITSTATUS(status), out};
}

}  // namespace dsv4::testing
