// SPDX-License-Identifier: MIT
// DeepSeek-V4 chat format vs golden prompts of DeepSeek's reference encoder (fixtures from vLLM, see
// tests/data/chat_format_v4/README.md), plus the rules those fixtures do not reach.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "chat_fixtures.h"
#include "tokenizer/chat_format.h"

using dsv4::ChatFormatOptions;
using dsv4::format_chat_v4;
using dsv4::ReasoningEffort;
using dsv4::ThinkingMode;
using Json = nlohmann::ordered_json;

namespace {

const auto& kFixtures = dsv4::test::kChatFixtures;
using dsv4::test::read_file;
std::string read(const std::filesystem::path& p) { return read_file(p); }

std::string render_fixture(int n, ThinkingMode mode) {
  const auto [messages, options] = dsv4::test::load_chat_fixture(n, mode);
  return format_chat_v4(messages, options);
}

const std::string kBos = "<｜begin▁of▁sentence｜>";
const std::string kEos = "<｜end▁of▁sentence｜>";

}  // namespace

TEST(ChatFormatV4, GoldenToolCallConversation) {
  EXPECT_EQ(render_fixture(1, ThinkingMode::kThinking), read(kFixtures / "test_output_1.txt"));
}

TEST(ChatFormatV4, DerivedMultiTurnDropsEarlierReasoning) {
  EXPECT_EQ(render_fixture(2, ThinkingMode::kThinking), read(kFixtures / "derived_output_2.txt"));
}

TEST(ChatFormatV4, GoldenDeveloperToolsLatestReminder) {
  EXPECT_EQ(render_fixture(3, ThinkingMode::kThinking), read(kFixtures / "test_output_3.txt"));
}

TEST(ChatFormatV4, GoldenChatModeActionTask) {
  EXPECT_EQ(render_fixture(4, ThinkingMode::kChat), read(kFixtures / "test_output_4.txt"));
}

TEST(ChatFormatV4, GenerationPromptPerMode) {
  const Json msgs = Json::parse(R"([{"role": "user", "content": "Hello"}])");
  ChatFormatOptions chat;
  chat.thinking_mode = ThinkingMode::kChat;
  EXPECT_EQ(format_chat_v4(msgs, chat), kBos + "<｜User｜>Hello<｜Assistant｜></think>");
  EXPECT_EQ(format_chat_v4(msgs), kBos + "<｜User｜>Hello<｜Assistant｜><think>");
  chat.add_bos = false;
  EXPECT_EQ(format_chat_v4(msgs, chat), "<｜User｜>Hello<｜Assistant｜></think>");
}

TEST(ChatFormatV4, MaxReasoningEffortPreambleOnlyInThinkingMode) {
  const Json msgs = Json::parse(R"([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}])");
  ChatFormatOptions o;
  o.reasoning_effort = ReasoningEffort::kMax;
  const std::string p = format_chat_v4(msgs, o);
  EXPECT_EQ(p.rfind(kBos + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very", 0), 0u)
      << p;
  EXPECT_NE(p.find("no assumption is left unchecked.\n\nS<｜User｜>Q<｜Assistant｜><think>"), std::string::npos) << p;
  o.reasoning_effort = ReasoningEffort::kHigh;
  EXPECT_EQ(format_chat_v4(msgs, o), kBos + "S<｜User｜>Q<｜Assistant｜><think>");
  o.reasoning_effort = ReasoningEffort::kMax;
  o.thinking_mode = ThinkingMode::kChat;
  EXPECT_EQ(format_chat_v4(msgs, o), kBos + "S<｜User｜>Q<｜Assistant｜></think>");
}

TEST(ChatFormatV4, PrefixAssistantTurnStaysOpen) {
  const Json msgs = Json::parse(R"([{"role": "user", "content": "Please write quick sort code"},
                                    {"role": "assistant", "content": "```python\n", "prefix": true}])");
  ChatFormatOptions o;
  o.thinking_mode = ThinkingMode::kChat;
  EXPECT_EQ(format_chat_v4(msgs, o), kBos + "<｜User｜>Please write quick sort code<｜Assistant｜></think>```python\n");
  o.thinking_mode = ThinkingMode::kThinking;  // the open turn gets an empty thought
  EXPECT_EQ(format_chat_v4(msgs, o),
            kBos + "<｜User｜>Please write quick sort code<｜Assistant｜><think></think>```python\n");
}

TEST(ChatFormatV4, ToolResultsFollowCallOrderAndMergeWithUserText) {
  const Json msgs = Json::parse(R"([
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "", "tool_calls": [
      {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1, \"y\": [1.5, true, null], \"s\": \"é\"}"}},
      {"id": "b", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
    {"role": "tool", "tool_call_id": "b", "content": "B"},
    {"role": "tool", "tool_call_id": "a", "content": "A"},
    {"role": "user", "content": "thanks"}])");
  ChatFormatOptions o;
  o.thinking_mode = ThinkingMode::kChat;
  EXPECT_EQ(format_chat_v4(msgs, o),
            kBos + "<｜User｜>Q<｜Assistant｜></think>\n\n<｜DSML｜tool_calls>\n"
                   "<｜DSML｜invoke name=\"f\">\n"
                   "<｜DSML｜parameter name=\"x\" string=\"false\">1</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"y\" string=\"false\">[1.5, true, null]</｜DSML｜parameter>\n"
                   "<｜DSML｜parameter name=\"s\" string=\"true\">é</｜DSML｜parameter>\n"
                   "</｜DSML｜invoke>\n"
                   "<｜DSML｜invoke name=\"g\">\n"
                   "<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>\n"
                   "</｜DSML｜invoke>\n</｜DSML｜tool_calls>" + kEos +
                   "<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\nthanks"
                   "<｜Assistant｜></think>");
}

TEST(ChatFormatV4, ContextIsNotRenderedButCountsForTheRules) {
  const Json context = Json::parse(R"([{"role": "user", "content": "Q1"},
                                       {"role": "assistant", "reasoning_content": "r1", "content": "A1"}])");
  const Json msgs = Json::parse(R"([{"role": "user", "content": "Q2"}])");
  // No BOS with a context; the new user turn is the last one, so thinking opens.
  EXPECT_EQ(format_chat_v4(msgs, {}, context), "<｜User｜>Q2<｜Assistant｜><think>");
  Json all = context;
  all.push_back(msgs[0]);
  EXPECT_EQ(format_chat_v4(all), kBos + "<｜User｜>Q1<｜Assistant｜></think>A1" + kEos + "<｜User｜>Q2<｜Assistant｜><think>");
  ChatFormatOptions keep;
  keep.drop_thinking = false;
  EXPECT_EQ(format_chat_v4(all, keep),
            kBos + "<｜User｜>Q1<｜Assistant｜><think>r1</think>A1" + kEos + "<｜User｜>Q2<｜Assistant｜><think>");
}

TEST(ChatFormatV4, RejectsWhatTheReferenceRejects) {
  EXPECT_THROW(format_chat_v4(Json::parse(R"([{"role": "robot", "content": "x"}])")), dsv4::Error);
  EXPECT_THROW(format_chat_v4(Json::parse(R"([{"role": "developer", "content": ""}])")), dsv4::Error);
  EXPECT_THROW(format_chat_v4(Json::parse(R"([{"role": "user", "content": "x", "task": "dance"}])")), dsv4::Error);
  EXPECT_THROW(format_chat_v4(Json::parse(R"([{"role": "assistant", "tool_calls": [
      {"function": {"name": "f", "arguments": "[1, 2]"}}]}])")), dsv4::Error);
}

TEST(ChatFormatV4, PythonJsonDumps) {
  using dsv4::python_json_dumps;
  EXPECT_EQ(python_json_dumps(Json::parse(R"({"a": [1, 2.0, -0.5], "b": {"c": null, "d": false}})")),
            R"({"a": [1, 2.0, -0.5], "b": {"c": null, "d": false}})");
  EXPECT_EQ(python_json_dumps(Json::parse("[1e16, 1e15, 0.0001, 0.00001, 1.5e-7, 123.456, 1e100]")),
            "[1e+16, 1000000000000000.0, 0.0001, 1e-05, 1.5e-07, 123.456, 1e+100]");
  EXPECT_EQ(python_json_dumps(Json("tab\there \"q\" \\ \x01 é 中")), "\"tab\\there \\\"q\\\" \\\\ \\u0001 é 中\"");
}
