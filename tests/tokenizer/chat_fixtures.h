// SPDX-License-Identifier: MIT
// The DeepSeek-V4 chat-format fixtures (tests/data/chat_format_v4/, from vLLM), shared by the encoder and the
// parser tests.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "tokenizer/chat_format.h"

namespace dsv4::test {

inline const std::filesystem::path kChatFixtures = std::filesystem::path(DSV4_TEST_DATA) / "chat_format_v4";

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << p;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Fixture input n as (messages, options with request-level tools): either a message list or
// {"messages": [...], "tools": [...]}.
inline std::pair<nlohmann::ordered_json, ChatFormatOptions> load_chat_fixture(int n, ThinkingMode mode) {
  const auto in = nlohmann::ordered_json::parse(
      read_file(kChatFixtures / ("test_input_" + std::to_string(n) + ".json")));
  ChatFormatOptions o;
  o.thinking_mode = mode;
  if (in.is_object()) {
    o.tools = in.value("tools", nlohmann::ordered_json());
    return {in["messages"], o};
  }
  return {in, o};
}

}  // namespace dsv4::test
