// SPDX-License-Identifier: MIT
// DeepSeek-V4 completion parsing (dsv4::parse_completion_v4), the decoder half of the reference
// encoding_dsv4.py: the assistant turns of the golden prompts (tests/data/chat_format_v4/) parsed
// back, a round trip through format_chat_v4 for every assistant turn of the fixtures, and malformed
// completions, which the reference rejects (here: dsv4::Error, never a crash).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/check.h"
#include "chat_fixtures.h"
#include "tokenizer/chat_format.h"

using dsv4::ChatFormatOptions;
using dsv4::format_chat_v4;
using dsv4::parse_completion_v4;
using dsv4::ParsedMessage;
using dsv4::ThinkingMode;
using Json = nlohmann::ordered_json;

namespace {

const auto& kFixtures = dsv4::test::kChatFixtures;

const std::string kEos = "<｜end▁of▁sentence｜>";
const std::string kAssistant = "<｜Assistant｜>";
const std::string kDsml = "｜DSML｜";

std::string read(const std::filesystem::path& p) { return dsv4::test::read_file(p); }

// The n-th assistant turn of a golden prompt: from after "<｜Assistant｜>" and the mode's opening
// token (plus an action task token) to its end-of-sentence token, inclusive.
std::string golden_completion(const std::string& golden, int n, std::string_view opening) {
  size_t pos = 0;
  for (int i = 0; i <= n; ++i) {
    pos = golden.find(kAssistant, pos);
    EXPECT_NE(pos, std::string::npos) << "no assistant turn #" << n;
    if (pos == std::string::npos) return "";
    pos += kAssistant.size();
  }
  EXPECT_EQ(golden.compare(pos, opening.size(), opening), 0) << golden.substr(pos, 40);
  pos += opening.size();
  const size_t end = golden.find(kEos, pos);
  EXPECT_NE(end, std::string::npos);
  return golden.substr(pos, end + kEos.size() - pos);
}

std::string invoke(const std::string& name, const std::string& params) {
  return "<" + kDsml + "invoke name=\"" + name + "\">\n" + params + "</" + kDsml + "invoke>\n";
}
std::string param(const std::string& name, bool is_string, const std::string& value) {
  return "<" + kDsml + "parameter name=\"" + name + "\" string=\"" + (is_string ? "true" : "false") + "\">" + value +
         "</" + kDsml + "parameter>\n";
}
std::string block(const std::string& invokes) {
  return "\n\n<" + kDsml + "tool_calls>\n" + invokes + "</" + kDsml + "tool_calls>";
}

std::pair<Json, ChatFormatOptions> load_fixture(int n, ThinkingMode mode) {
  return dsv4::test::load_chat_fixture(n, mode);
}

Json slice(const Json& messages, size_t n) {
  Json out = Json::array();
  for (size_t i = 0; i < n; ++i) out.push_back(messages[i]);
  return out;
}

std::string text_field(const Json& msg, const char* key) {
  return msg.contains(key) && msg[key].is_string() ? msg[key].get<std::string>() : "";
}

// The arguments an assistant message carries, as the encoder reads them (a JSON object string, or
// anything else under "arguments").
Json arguments_of(const Json& tool_call) {
  const Json& a = tool_call["function"]["arguments"];
  if (a.is_string()) {
    Json parsed = Json::parse(a.get<std::string>(), nullptr, false);
    if (!parsed.is_discarded()) return parsed;
  }
  return Json{{"arguments", a}};
}

// Every assistant turn of a fixture: render the conversation up to it and up to just before it;
// the difference is the completion the model would have produced. Parse it, compare with the
// message, and check that the parsed message renders to the same prompt.
int round_trip_fixture(int n, ThinkingMode mode) {
  auto [messages, options] = load_fixture(n, mode);
  int checked = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& msg = messages[i];
    if (msg["role"] != "assistant") continue;
    SCOPED_TRACE("fixture " + std::to_string(n) + " message #" + std::to_string(i));
    const std::string before = format_chat_v4(slice(messages, i), options);
    const std::string with = format_chat_v4(slice(messages, i + 1), options);
    EXPECT_EQ(with.compare(0, before.size(), before), 0);
    const std::string completion = with.substr(before.size());
    const bool after_task = i > 0 && messages[i - 1].contains("task");

    const ParsedMessage p = parse_completion_v4(completion, after_task ? ThinkingMode::kChat : mode);
    EXPECT_EQ(p.content, text_field(msg, "content"));
    const std::string reasoning =
        msg.contains("reasoning_content") ? text_field(msg, "reasoning_content") : text_field(msg, "reasoning");
    EXPECT_EQ(p.reasoning_content, mode == ThinkingMode::kThinking && !after_task ? reasoning : "");
    const Json calls = msg.value("tool_calls", Json::array());
    EXPECT_EQ(p.tool_calls.size(), calls.size());
    for (size_t k = 0; k < std::min(p.tool_calls.size(), calls.size()); ++k) {
      EXPECT_EQ(p.tool_calls[k].name, calls[k]["function"]["name"]);
      EXPECT_EQ(Json::parse(p.tool_calls[k].arguments), arguments_of(calls[k])) << p.tool_calls[k].arguments;
    }

    Json replaced = slice(messages, i);
    replaced.push_back(p.to_json());
    EXPECT_EQ(format_chat_v4(replaced, options), with);
    ++checked;
  }
  return checked;
}

void expect_rejected(const std::string& text, ThinkingMode mode, const std::string& why) {
  EXPECT_THROW(parse_completion_v4(text, mode), dsv4::Error) << why << ": " << text;
}

}  // namespace

TEST(ChatParseV4, GoldenToolCallTurn) {
  const std::string c = golden_completion(read(kFixtures / "test_output_1.txt"), 0, "<think>");
  const ParsedMessage p = parse_completion_v4(c, ThinkingMode::kThinking);
  EXPECT_EQ(p.reasoning_content, "The user wants to know the weather in Beijing. I should use the get_weather tool.");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].name, "get_weather");
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"location": "Beijing", "unit": "celsius"})");
}

TEST(ChatParseV4, GoldenFinalAnswerTurn) {
  const std::string c = golden_completion(read(kFixtures / "test_output_1.txt"), 1, "<think>");
  const ParsedMessage p = parse_completion_v4(c, ThinkingMode::kThinking);
  EXPECT_EQ(p.reasoning_content, "Got the weather data. Let me format a nice response.");
  EXPECT_EQ(p.content, "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity.");
  EXPECT_TRUE(p.tool_calls.empty());
}

TEST(ChatParseV4, GoldenNonAsciiToolCall) {
  const std::string golden = read(kFixtures / "test_output_3.txt");
  const ParsedMessage p = parse_completion_v4(golden_completion(golden, 0, "<think>"), ThinkingMode::kThinking);
  EXPECT_EQ(p.reasoning_content, "用户想知道小柴胡冲剂和布洛芬能否一起服用。");
  EXPECT_EQ(p.content, "");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].name, "search");
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"queries": "小柴胡冲剂 布洛芬 相互作用 一起吃"})");
  const ParsedMessage last = parse_completion_v4(golden_completion(golden, 1, "<think>"), ThinkingMode::kThinking);
  EXPECT_EQ(last.reasoning_content, "现在开始组织回答。");
  EXPECT_EQ(last.content, "请及时就医。");
  EXPECT_TRUE(last.tool_calls.empty());
}

TEST(ChatParseV4, GoldenChatModeTurns) {
  const std::string golden = read(kFixtures / "test_output_4.txt");
  const ParsedMessage first = parse_completion_v4(golden_completion(golden, 0, "</think>"), ThinkingMode::kChat);
  EXPECT_EQ(first.reasoning_content, "");
  EXPECT_EQ(first.content.rfind("关于热海大滚锅是否是世界著名温泉", 0), 0u);
  EXPECT_NE(first.content.find("| :--- | :--- |\n"), std::string::npos);
  const ParsedMessage action =
      parse_completion_v4(golden_completion(golden, 1, "</think><｜action｜>"), ThinkingMode::kChat);
  EXPECT_EQ(action.content, "Search");
  EXPECT_TRUE(action.tool_calls.empty());
}

TEST(ChatParseV4, RoundTripEveryFixtureAssistantTurn) {
  EXPECT_EQ(round_trip_fixture(1, ThinkingMode::kThinking), 2);
  EXPECT_EQ(round_trip_fixture(2, ThinkingMode::kThinking), 2);
  EXPECT_EQ(round_trip_fixture(3, ThinkingMode::kThinking), 2);
  EXPECT_EQ(round_trip_fixture(4, ThinkingMode::kChat), 2);
  // The same conversations in the other mode.
  EXPECT_EQ(round_trip_fixture(1, ThinkingMode::kChat), 2);
  EXPECT_EQ(round_trip_fixture(2, ThinkingMode::kChat), 2);
  EXPECT_EQ(round_trip_fixture(3, ThinkingMode::kChat), 2);
  EXPECT_EQ(round_trip_fixture(4, ThinkingMode::kThinking), 2);
}

TEST(ChatParseV4, RoundTripArgumentTypesAndSeveralCalls) {
  // String and JSON-typed parameters, text that needs escaping in JSON, a call without arguments,
  // and arguments that are not a JSON object (the encoder's "arguments" fallback).
  const Json messages = Json::parse(R"([
    {"role": "user", "content": "go"},
    {"role": "assistant", "reasoning_content": "Plan: two calls.", "content": "Calling tools.",
     "tool_calls": [
       {"type": "function", "function": {"name": "mixed", "arguments":
         "{\"s\": \"a \\\"quoted\\\" line\\nand a tab\\t and \\\\ slash\", \"i\": 42, \"f\": 0.5, \"big\": 1e+16, \"b\": true, \"n\": null, \"arr\": [1, \"x\", {\"k\": []}], \"obj\": {\"u\": \"ünï\"}, \"empty\": \"\"}"}},
       {"type": "function", "function": {"name": "no_args", "arguments": "{}"}},
       {"type": "function", "function": {"name": "raw", "arguments": "not json at all"}}
     ]}
  ])");
  for (ThinkingMode mode : {ThinkingMode::kThinking, ThinkingMode::kChat}) {
    ChatFormatOptions o;
    o.thinking_mode = mode;
    const std::string before = format_chat_v4(slice(messages, 1), o);
    const std::string with = format_chat_v4(messages, o);
    const ParsedMessage p = parse_completion_v4(with.substr(before.size()), mode);
    EXPECT_EQ(p.reasoning_content, mode == ThinkingMode::kThinking ? "Plan: two calls." : "");
    EXPECT_EQ(p.content, "Calling tools.");
    ASSERT_EQ(p.tool_calls.size(), 3u);
    EXPECT_EQ(p.tool_calls[0].name, "mixed");
    EXPECT_EQ(Json::parse(p.tool_calls[0].arguments), arguments_of(messages[1]["tool_calls"][0]));
    EXPECT_EQ(p.tool_calls[0].arguments,
              R"({"s": "a \"quoted\" line\nand a tab\t and \\ slash", "i": 42, "f": 0.5, "big": 1e+16, "b": true, )"
              R"("n": null, "arr": [1, "x", {"k": []}], "obj": {"u": "ünï"}, "empty": ""})");
    EXPECT_EQ(p.tool_calls[1].name, "no_args");
    EXPECT_EQ(p.tool_calls[1].arguments, "{}");
    EXPECT_EQ(p.tool_calls[2].name, "raw");
    EXPECT_EQ(p.tool_calls[2].arguments, R"({"arguments": "not json at all"})");
    Json again = slice(messages, 1);
    again.push_back(p.to_json());
    EXPECT_EQ(format_chat_v4(again, o), with);
  }
}

TEST(ChatParseV4, MessageJsonShape) {
  const ParsedMessage p = parse_completion_v4("Hi." + kEos, ThinkingMode::kChat);
  EXPECT_EQ(p.to_json(), Json::parse(R"({"role": "assistant", "content": "Hi.", "reasoning_content": "",
                                         "tool_calls": []})"));
  const ParsedMessage t = parse_completion_v4(
      "</think>" + block(invoke("f", param("x", false, "1"))) + kEos, ThinkingMode::kThinking);
  EXPECT_EQ(t.to_json()["tool_calls"], Json::parse(R"([{"type": "function",
                                                        "function": {"name": "f", "arguments": "{\"x\": 1}"}}])"));
}

TEST(ChatParseV4, EndOfSentenceToken) {
  EXPECT_EQ(parse_completion_v4("Hello" + kEos, ThinkingMode::kChat).content, "Hello");
  EXPECT_EQ(parse_completion_v4(kEos, ThinkingMode::kChat).content, "");
  EXPECT_EQ(parse_completion_v4("r</think>" + kEos, ThinkingMode::kThinking).reasoning_content, "r");
  // Without tool calls the token is required, as in the reference...
  expect_rejected("Hello", ThinkingMode::kChat, "no EOS");
  expect_rejected("r</think>Hello", ThinkingMode::kThinking, "no EOS");
  // ...after a tool-call block it may be left off.
  const ParsedMessage p = parse_completion_v4("x" + block(invoke("f", "")), ThinkingMode::kChat);
  EXPECT_EQ(p.content, "x");
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, "{}");
  // Nothing may follow it.
  expect_rejected("Hello" + kEos + " more", ThinkingMode::kChat, "text after EOS");
  expect_rejected("Hello" + kEos + kEos, ThinkingMode::kChat, "two EOS");
  expect_rejected("x" + block(invoke("f", "")) + kEos + "\n", ThinkingMode::kChat, "text after EOS");
  expect_rejected("x" + block(invoke("f", "")) + "\n" + kEos, ThinkingMode::kChat, "text after the block");
}

TEST(ChatParseV4, ThinkingModeNeedsThinkEnd) {
  expect_rejected("still thinking" + kEos, ThinkingMode::kThinking, "no </think>");
  // A tool-call block before </think> is not reasoning.
  expect_rejected("plan" + block(invoke("f", "")) + kEos, ThinkingMode::kThinking, "tool calls inside thinking");
  // In chat mode "</think>" is a special token left in the content.
  expect_rejected("a</think>b" + kEos, ThinkingMode::kChat, "</think> in chat content");
  expect_rejected("a</think>b</think>c" + kEos, ThinkingMode::kThinking, "second </think>");
  expect_rejected("<think>a</think>b" + kEos, ThinkingMode::kThinking, "<think> in reasoning");
}

TEST(ChatParseV4, SpecialTokensInContentRejected) {
  expect_rejected("a<｜begin▁of▁sentence｜>b" + kEos, ThinkingMode::kChat, "BOS in content");
  expect_rejected("a <think> b" + kEos, ThinkingMode::kChat, "<think> in content");
  // A DSML block not opened by "\n\n" is not a tool call, and DSML may not stay in the content.
  expect_rejected("x\n<" + kDsml + "tool_calls>\n" + invoke("f", "") + "</" + kDsml + "tool_calls>" + kEos,
                  ThinkingMode::kChat, "block without the blank line");
}

TEST(ChatParseV4, UnterminatedBlockRejectedAtEveryCut) {
  const std::string full = "Let me check." +
                           block(invoke("get_weather", param("location", true, "Beijing") + param("days", false, "3")) +
                                 invoke("get_time", "")) +
                           kEos;
  const ParsedMessage p = parse_completion_v4(full, ThinkingMode::kChat);
  ASSERT_EQ(p.tool_calls.size(), 2u);
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"location": "Beijing", "days": 3})");
  // Every proper prefix is rejected (a completion cut by max_tokens or a stop string) except the
  // one that only lacks the end-of-sentence token. Where the reference runs out of text right after
  // a parameter or invoke tag it keeps the half-written call; here the block must be closed.
  const size_t without_eos = full.size() - kEos.size();
  for (size_t n = 0; n < full.size(); ++n) {
    if (n == without_eos) {
      EXPECT_EQ(parse_completion_v4(full.substr(0, n), ThinkingMode::kChat).tool_calls.size(), 2u);
      continue;
    }
    expect_rejected(full.substr(0, n), ThinkingMode::kChat, "cut at " + std::to_string(n));
  }
  // The close tag missing before the end-of-sentence token.
  expect_rejected("x\n\n<" + kDsml + "tool_calls>\n" + invoke("f", param("a", true, "b")) + kEos,
                  ThinkingMode::kChat, "no </tool_calls>");
  expect_rejected("x\n\n<" + kDsml + "tool_calls>\n<" + kDsml + "invoke name=\"f\">\n" + kEos, ThinkingMode::kChat,
                  "no </invoke>");
}

TEST(ChatParseV4, MalformedTagsRejected) {
  auto completion = [](const std::string& invokes) { return "c" + block(invokes) + kEos; };
  // Parameter without the string attribute, or with another value for it.
  expect_rejected(completion(invoke("f", "<" + kDsml + "parameter name=\"a\">1</" + kDsml + "parameter>\n")),
                  ThinkingMode::kChat, "no string=");
  expect_rejected(completion(invoke("f", "<" + kDsml + "parameter name=\"a\" string=\"yes\">1</" + kDsml +
                                             "parameter>\n")),
                  ThinkingMode::kChat, "string=yes");
  expect_rejected(completion(invoke("f", param("a", true, "1") + param("a", false, "2"))), ThinkingMode::kChat,
                  "duplicate parameter");
  // Separators other than ">\n".
  expect_rejected("c\n\n<" + kDsml + "tool_calls> \n" + invoke("f", "") + "</" + kDsml + "tool_calls>" + kEos,
                  ThinkingMode::kChat, "space before newline");
  expect_rejected(completion("<" + kDsml + "invoke name=\"f\">\n" + param("a", true, "1") + "  </" + kDsml +
                             "invoke>\n"),
                  ThinkingMode::kChat, "text between parameter and </invoke>");
  expect_rejected(completion("<" + kDsml + "invoke name=\"f\">" + param("a", true, "1") + "</" + kDsml + "invoke>\n"),
                  ThinkingMode::kChat, "no newline after the invoke tag");
  expect_rejected(completion("<" + kDsml + "invoke nam=\"f\">\n</" + kDsml + "invoke>\n"), ThinkingMode::kChat,
                  "bad invoke attribute");
  expect_rejected(completion("junk\n" + invoke("f", "")), ThinkingMode::kChat, "text before the invoke");
}

TEST(ChatParseV4, NonStringParameterCopiedVerbatim) {
  // As the reference, a string="false" value is not checked: a bad JSON value gives arguments that
  // do not parse, and the caller decides (the model was told to write JSON there).
  const ParsedMessage p = parse_completion_v4(
      "c" + block(invoke("f", param("ok", false, "[1, 2]") + param("bad", false, "{not json"))) + kEos,
      ThinkingMode::kChat);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(p.tool_calls[0].arguments, R"({"ok": [1, 2], "bad": {not json})");
  EXPECT_TRUE(Json::parse(p.tool_calls[0].arguments, nullptr, false).is_discarded());
  // A string="true" value is taken as is, JSON-looking or not, and quoted.
  const ParsedMessage s =
      parse_completion_v4("c" + block(invoke("f", param("v", true, "{\"a\": 1}"))) + kEos, ThinkingMode::kChat);
  EXPECT_EQ(s.tool_calls[0].arguments, R"({"v": "{\"a\": 1}"})");
}

TEST(ChatParseV4, ParameterValuesKeepNewlinesAndTags) {
  // Values are everything up to the closing parameter tag: newlines, "<", ">" and quotes stay.
  const ParsedMessage p = parse_completion_v4(
      "c" + block(invoke("write", param("path", true, "a.txt") + param("text", true, "line 1\n<b>\"x\" string=\"true\">\n"))) +
          kEos,
      ThinkingMode::kChat);
  ASSERT_EQ(p.tool_calls.size(), 1u);
  EXPECT_EQ(Json::parse(p.tool_calls[0].arguments),
            Json({{"path", "a.txt"}, {"text", "line 1\n<b>\"x\" string=\"true\">\n"}}));
}
