// SPDX-License-Identifier: MIT
// The DeepSeek-V4 chat prompt format, written as code. V4 ships no Jinja template; its reference is
// the Python encoder in the model repo (encoding/encoding_dsv4.py, `encode_messages`), and this is a
// line-by-line port of its rules (golden fixtures from vLLM in tests/data/chat_format_v4/):
//
//   BOS? [Reasoning-Effort preamble] system content ["\n\n## Tools ..."] ["\n\n## Response Format ..."]
//   <｜User｜>user text<｜Assistant｜>  +  "<think>" (thinking mode) or "</think>" (chat mode)
//   assistant turn: [reasoning "</think>"] content ["\n\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>"] EOS
//
// * There is no tool role: tool results join the following user turn as <tool_result>…</tool_result>,
//   sorted in the order of the assistant's tool calls.
// * In thinking mode, reasoning of assistant turns before the last user turn is dropped (as are
//   developer turns there), unless drop_thinking is false or any message carries tools.
// * Roles: system, developer (a user turn carrying instructions/tools), user, assistant, tool,
//   latest_reminder (<｜latest_reminder｜>content). A message's "task" (action, query, authority,
//   domain, title, read_url) appends that task token instead of the usual transition.
// * Assistant fields: content, reasoning_content (alias: reasoning), tool_calls (OpenAI format;
//   arguments as a JSON string or object), wo_eos (alias: prefix) to leave the turn open for prefill.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

namespace dsv4 {

enum class ThinkingMode { kChat, kThinking };

// encoding_dsv4.py accepts None, "high" and "max"; only "max" changes the prompt (a preamble in
// thinking mode).
enum class ReasoningEffort { kDefault, kHigh, kMax };

struct ChatFormatOptions {
  ThinkingMode thinking_mode = ThinkingMode::kThinking;
  bool drop_thinking = true;  // drop reasoning of turns before the last user turn
  bool add_bos = true;        // add_default_bos_token (only when there is no context)
  ReasoningEffort reasoning_effort = ReasoningEffort::kDefault;
  // Request-level tools (OpenAI format). As vLLM's V4 wrapper does, they are attached to the leading
  // system/developer message, or to a new empty system message put first. null/empty: none.
  nlohmann::ordered_json tools;
};

// The prompt string for messages (an OpenAI-style JSON array). context: messages already encoded
// earlier (a prefix of the conversation, e.g. a cached prompt); only `messages` are rendered, but
// the context takes part in the rules (last user turn, tool-result order). Throws dsv4::Error on
// input the reference rejects (unknown role, empty developer content, bad task, malformed
// tool-call arguments).
std::string format_chat_v4(const nlohmann::ordered_json& messages, const ChatFormatOptions& options = {},
                           const nlohmann::ordered_json& context = nlohmann::ordered_json::array());

// Python's json.dumps(value, ensure_ascii=False): ", " and ": " separators, non-ASCII kept, floats
// in repr() form (1.0, 1e-05, 1e+16). The format embeds tool schemas and arguments this way.
std::string python_json_dumps(const nlohmann::ordered_json& value);

}  // namespace dsv4
