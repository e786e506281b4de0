// SPDX-License-Identifier: MIT
// `dsv4 chat` end to end on models/tiny (random weights, truncated DeepSeek tokenizer): the first
// reply must be exactly what `dsv4 generate` produces from the V4 chat-format prompt, in both modes,
// and a second turn must run on the same session.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tokenizer/chat_format.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;

namespace {

const fs::path kTiny = fs::path(DSV4_SOURCE_DIR) / "models" / "tiny";

struct Result {
  int rc;
  std::string out;
};

Result run(const std::string& cmd) {
  Result r{-1, ""};
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  r.rc = pclose(p);
  return r;
}

void check_first_reply(bool thinking) {
  ASSERT_TRUE(fs::exists(kTiny / "tokenizer.json")) << kTiny << " is missing";
  const dsv4::Tokenizer tok = dsv4::Tokenizer::load(kTiny.string());
  dsv4::ChatFormatOptions o;
  o.thinking_mode = thinking ? dsv4::ThinkingMode::kThinking : dsv4::ThinkingMode::kChat;
  const auto prompt = tok.encode(dsv4::format_chat_v4(nlohmann::ordered_json::parse(
                                                          R"([{"role": "user", "content": "Hello there"}])"),
                                                      o));
  std::string ids;
  for (int32_t id : prompt) ids += (ids.empty() ? "" : ",") + std::to_string(id);
  const std::string bin = DSV4_BINARY;
  const std::string common = " --model '" + kTiny.string() + "' --max-new-tokens 12 --max-context 2048";
  const Result gen = run(bin + " generate" + common + " --prompt-ids " + ids + " --json 2>/dev/null");
  ASSERT_EQ(gen.rc, 0) << gen.out;
  const auto j = nlohmann::json::parse(gen.out);
  const std::string expected = tok.decode(j["output_ids"].get<std::vector<int32_t>>(), /*skip_special=*/true);

  const fs::path err = fs::temp_directory_path() / ("dsv4_chat_cli_" + std::to_string(::getpid()) + ".log");
  const Result chat = run("printf 'Hello there\\nAnd a second turn\\n' | " + bin + " chat" + common +
                          (thinking ? "" : " --no-think") + " 2>'" + err.string() + "'");
  std::ifstream log(err);
  std::stringstream ss;
  ss << log.rdbuf();
  fs::remove(err);
  ASSERT_EQ(chat.rc, 0) << chat.out << ss.str();
  EXPECT_EQ(chat.out.rfind("> " + expected + "\n> ", 0), 0u)
      << "chat printed:\n" << chat.out << "\ngenerate on the same prompt gives:\n" << expected;
  // Three prompts: two turns answered, then end of input.
  size_t prompts = 0;
  for (size_t at = chat.out.find("> "); at != std::string::npos; at = chat.out.find("> ", at + 2)) ++prompts;
  EXPECT_GE(prompts, 3u) << chat.out;
}

}  // namespace

TEST(ChatCli, FirstReplyEqualsGenerateInChatMode) { check_first_reply(false); }
TEST(ChatCli, FirstReplyEqualsGenerateInThinkingMode) { check_first_reply(true); }
