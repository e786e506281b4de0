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
#include <string_view>
#include <vector>

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

// One tool call parsed back from DSML: arguments is a JSON object as text, built as the reference
// builds it: each parameter marked string="true" becomes a JSON string, any other value is copied
// verbatim (it should already be JSON, and is not checked: a bad value gives arguments that do not
// parse, as in the reference).
struct ParsedToolCall {
  std::string name;
  std::string arguments;
};

// An assistant turn parsed back from the model's completion text.
struct ParsedMessage {
  std::string reasoning_content;  // empty in chat mode
  std::string content;
  std::vector<ParsedToolCall> tool_calls;

  // The reference's dict: {"role": "assistant", "content", "reasoning_content", "tool_calls":
  // [{"type": "function", "function": {"name", "arguments"}}]}; format_chat_v4 takes it back.
  nlohmann::ordered_json to_json() const;
};

// The decoder half of encoding_dsv4.py (`parse_message_from_completion_text`): the text the model
// generated after the prompt (after "<think>" in thinking mode, after "</think>" in chat mode):
//
//   [reasoning "</think>"] content ["\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"N\">\n
//   <｜DSML｜parameter name=\"K\" string=\"true|false\">V</｜DSML｜parameter>\n...</｜DSML｜invoke>\n
//   ...</｜DSML｜tool_calls>"] EOS
//
// As the reference, it parses only well-formed text and throws dsv4::Error otherwise: thinking mode
// without "</think>" before the tool calls, content without the end-of-sentence token (after a
// tool-call block the token is optional), anything after it, DSML tags out of shape, a duplicate
// parameter, special tokens left in content or reasoning. One deliberate difference: the reference
// stops reading when the text runs out, so a completion cut right after a parameter or invoke tag
// passes with a half-written call; here the block must end with "</｜DSML｜tool_calls>".
ParsedMessage parse_completion_v4(std::string_view text, ThinkingMode mode);

// Python's json.dumps(value, ensure_ascii=False): ", " and ": " separators, non-ASCII kept, floats
// in repr() form (1.0, 1e-05, 1e+16). The format embeds tool schemas and arguments this way.
std::string python_json_dumps(const nlohmann::ordered_json& value);

}  // namespace dsv4
