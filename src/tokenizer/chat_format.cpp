// SPDX-License-Identifier: MIT
// DeepSeek-V4 chat format. The reference encoder is Python working on dicts, so this works on JSON
// and keeps its notions: a missing key reads as null, "truthy" is Python's truthiness, and a null
// formatted into a template prints "None".
#include "tokenizer/chat_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>

#include "core/check.h"

namespace dsv4 {

namespace {

using Json = nlohmann::ordered_json;

constexpr std::string_view kBos = "<｜begin▁of▁sentence｜>";
constexpr std::string_view kEos = "<｜end▁of▁sentence｜>";
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";
constexpr std::string_view kDsml = "｜DSML｜";
constexpr std::string_view kUser = "<｜User｜>";
constexpr std::string_view kAssistant = "<｜Assistant｜>";
constexpr std::string_view kLatestReminder = "<｜latest_reminder｜>";

const std::map<std::string, std::string>& task_tokens() {
  static const std::map<std::string, std::string> m = {
      {"action", "<｜action｜>"}, {"query", "<｜query｜>"}, {"authority", "<｜authority｜>"},
      {"domain", "<｜domain｜>"}, {"title", "<｜title｜>"}, {"read_url", "<｜read_url｜>"}};
  return m;
}

constexpr std::string_view kReasoningEffortMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

std::string tools_section(const std::string& tool_schemas) {
  const std::string d(kDsml);
  return "## Tools\n\n"
         "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
         "\"<" + d + "tool_calls>\" block like the following:\n\n"
         "<" + d + "tool_calls>\n"
         "<" + d + "invoke name=\"$TOOL_NAME\">\n"
         "<" + d + "parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" + d + "parameter>\n"
         "...\n"
         "</" + d + "invoke>\n"
         "<" + d + "invoke name=\"$TOOL_NAME2\">\n"
         "...\n"
         "</" + d + "invoke>\n"
         "</" + d + "tool_calls>\n\n"
         "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
         "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
         "If thinking_mode is enabled (triggered by " + std::string(kThinkStart) + "), you MUST output your complete "
         "reasoning inside " + std::string(kThinkStart) + "..." + std::string(kThinkEnd) +
         " BEFORE any tool calls or final response.\n\n"
         "Otherwise, output directly after " + std::string(kThinkEnd) + " with tool calls or final response.\n\n"
         "### Available Tool Schemas\n\n" + tool_schemas + "\n\n"
         "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n";
}

// msg.get(key): null when absent.
const Json& get(const Json& obj, std::string_view key) {
  static const Json null_value;
  if (!obj.is_object()) return null_value;
  auto it = obj.find(std::string(key));
  return it == obj.end() ? null_value : *it;
}

bool truthy(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null: return false;
    case Json::value_t::boolean: return v.get<bool>();
    case Json::value_t::string: return !v.get_ref<const std::string&>().empty();
    case Json::value_t::array:
    case Json::value_t::object: return !v.empty();
    case Json::value_t::number_integer: return v.get<int64_t>() != 0;
    case Json::value_t::number_unsigned: return v.get<uint64_t>() != 0;
    case Json::value_t::number_float: return v.get<double>() != 0.0;
    default: return true;
  }
}

// Python `value or ""` for a field that must be text.
std::string text_or_empty(const Json& v, std::string_view what) {
  if (!truthy(v)) return "";
  DSV4_CHECK(v.is_string(), "chat message: {} must be a string, got {}", what, v.dump());
  return v.get<std::string>();
}

// Python "{x}".format(x=v) for a field that should be text: None prints "None".
std::string format_text(const Json& v, std::string_view what) {
  if (v.is_null()) return "None";
  DSV4_CHECK(v.is_string(), "chat message: {} must be a string, got {}", what, v.dump());
  return v.get<std::string>();
}

std::string python_float(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  if (x == 0) return std::signbit(x) ? "-0.0" : "0.0";
  // Shortest round-trip digits, then Python's repr layout: fixed when -4 < decpt <= 16.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string sign;
  if (sci[0] == '-') sign = "-", sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp10 = std::stoi(sci.substr(e + 1));
  const int decpt = exp10 + 1;  // value = 0.DIGITS * 10^decpt
  const int n = static_cast<int>(digits.size());
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out = "0." + std::string(-decpt, '0') + digits;
    } else if (decpt >= n) {
      out = digits + std::string(decpt - n, '0') + ".0";
    } else {
      out = digits.substr(0, decpt) + "." + digits.substr(decpt);
    }
  } else {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int ex = decpt - 1;
    out += fmt::format("e{}{:02d}", ex < 0 ? '-' : '+', std::abs(ex));
  }
  return sign + out;
}

void dump_string(const std::string& s, std::string& out) {
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out.push_back(static_cast<char>(c));
    }
  }
  out.push_back('"');
}

void dump(const Json& v, std::string& out) {
  switch (v.type()) {
    case Json::value_t::null: out += "null"; break;
    case Json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; break;
    case Json::value_t::number_integer: out += std::to_string(v.get<int64_t>()); break;
    case Json::value_t::number_unsigned: out += std::to_string(v.get<uint64_t>()); break;
    case Json::value_t::number_float: out += python_float(v.get<double>()); break;
    case Json::value_t::string: dump_string(v.get_ref<const std::string&>(), out); break;
    case Json::value_t::array: {
      out.push_back('[');
      bool first = true;
      for (const auto& e : v) {
        if (!first) out += ", ";
        first = false;
        dump(e, out);
      }
      out.push_back(']');
      break;
    }
    case Json::value_t::object: {
      out.push_back('{');
      bool first = true;
      for (const auto& [k, e] : v.items()) {
        if (!first) out += ", ";
        first = false;
        dump_string(k, out);
        out += ": ";
        dump(e, out);
      }
      out.push_back('}');
      break;
    }
    default: DSV4_FAIL("chat format: cannot serialise a {} value", v.type_name());
  }
}

std::string render_tools(const Json& tools) {
  std::string schemas;
  for (const auto& tool : tools) {
    DSV4_CHECK(tool.is_object() && tool.contains("function"),
               "chat message: each tool must be {{\"type\": \"function\", \"function\": {{...}}}}, got {}", tool.dump());
    if (!schemas.empty()) schemas += "\n";
    schemas += python_json_dumps(tool["function"]);
  }
  return tools_section(schemas);
}

// Tool-call arguments as DSML parameters. A string that parses as a JSON object gives one parameter
// per key; anything else becomes a single parameter named "arguments" (the reference's fallback).
std::string arguments_to_dsml(const Json& arguments) {
  Json parsed;
  if (arguments.is_string()) {
    parsed = Json::parse(arguments.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) parsed = Json::object({{"arguments", arguments}});
  } else {
    parsed = Json::object({{"arguments", arguments}});
  }
  DSV4_CHECK(parsed.is_object(), "chat message: tool-call arguments must be a JSON object, got {}", parsed.dump());
  std::string out;
  const std::string d(kDsml);
  for (const auto& [key, value] : parsed.items()) {
    if (!out.empty()) out += "\n";
    out += "<" + d + "parameter name=\"" + key + "\" string=\"" + (value.is_string() ? "true" : "false") + "\">" +
           (value.is_string() ? value.get<std::string>() : python_json_dumps(value)) + "</" + d + "parameter>";
  }
  return out;
}

std::string reasoning_of(const Json& msg) {
  const Json& rc = get(msg, "reasoning_content");
  return text_or_empty(rc.is_null() ? get(msg, "reasoning") : rc, "reasoning_content");
}

int find_last_user_index(const Json& messages) {
  for (int i = static_cast<int>(messages.size()) - 1; i >= 0; --i) {
    const Json& role = get(messages[i], "role");
    if (role == "user" || role == "developer") return i;
  }
  return -1;
}

std::string render_message(int index, const Json& messages, ThinkingMode mode, bool drop_thinking,
                           ReasoningEffort effort) {
  const bool thinking = mode == ThinkingMode::kThinking;
  const Json& msg = messages[index];
  const int last_user = find_last_user_index(messages);
  const Json& role_json = get(msg, "role");
  DSV4_CHECK(role_json.is_string(), "chat message #{}: missing \"role\"", index);
  const std::string role = role_json.get<std::string>();
  const Json& content = get(msg, "content");
  const Json& tools = get(msg, "tools");
  const Json& response_format = get(msg, "response_format");

  std::string prompt;
  if (index == 0 && thinking && effort == ReasoningEffort::kMax) prompt += kReasoningEffortMax;

  auto append_tools_and_format = [&](std::string& s) {
    if (truthy(tools)) s += "\n\n" + render_tools(tools);
    if (truthy(response_format)) {
      s += "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n" +
           python_json_dumps(response_format);
    }
  };

  if (role == "system") {
    prompt += text_or_empty(content, "system content");
    append_tools_and_format(prompt);
  } else if (role == "developer") {
    DSV4_CHECK(truthy(content), "chat message #{}: a developer message needs non-empty content", index);
    std::string s = std::string(kUser) + text_or_empty(content, "developer content");
    append_tools_and_format(s);
    prompt += s;
  } else if (role == "user") {
    prompt += kUser;
    const Json& blocks = get(msg, "content_blocks");
    if (truthy(blocks)) {
      std::string joined;
      bool first = true;
      for (const auto& block : blocks) {
        const Json& type = get(block, "type");
        std::string part;
        if (type == "text") {
          const Json& t = get(block, "text");
          DSV4_CHECK(t.is_string(), "chat message #{}: a text block needs a string \"text\"", index);
          part = t.get<std::string>();
        } else if (type == "tool_result") {
          const Json& tc = block.contains("content") ? block["content"] : Json("");
          std::string inner;
          if (tc.is_array()) {
            bool first_part = true;
            for (const auto& b : tc) {
              if (!first_part) inner += "\n\n";
              first_part = false;
              if (get(b, "type") == "text") inner += text_or_empty(b.contains("text") ? b["text"] : Json(""), "text");
              else inner += "[Unsupported " + format_text(get(b, "type"), "block type") + "]";
            }
          } else {
            inner = format_text(tc, "tool result content");
          }
          part = "<tool_result>" + inner + "</tool_result>";
        } else {
          part = "[Unsupported " + format_text(type, "block type") + "]";
        }
        if (!first) joined += "\n\n";
        first = false;
        joined += part;
      }
      prompt += joined;
    } else {
      prompt += text_or_empty(content, "user content");
    }
  } else if (role == "latest_reminder") {
    prompt += std::string(kLatestReminder) + format_text(content, "latest_reminder content");
  } else if (role == "assistant") {
    std::string tool_calls_text;
    const Json& tool_calls = get(msg, "tool_calls");
    if (truthy(tool_calls)) {
      const std::string d(kDsml);
      std::string calls;
      for (const auto& tc : tool_calls) {
        DSV4_CHECK(tc.is_object() && tc.contains("function") && tc["function"].contains("name") &&
                       tc["function"].contains("arguments"),
                   "chat message #{}: each tool call needs function.name and function.arguments, got {}", index,
                   tc.dump());
        if (!calls.empty()) calls += "\n";
        calls += "<" + d + "invoke name=\"" + format_text(tc["function"]["name"], "tool name") + "\">\n" +
                 arguments_to_dsml(tc["function"]["arguments"]) + "\n</" + d + "invoke>";
      }
      tool_calls_text = "\n\n<" + d + "tool_calls>\n" + calls + "\n</" + d + "tool_calls>";
    }
    const bool prev_has_task = index >= 1 && !get(messages[index - 1], "task").is_null();
    std::string thinking_part;
    if (thinking && !prev_has_task && (!drop_thinking || index > last_user)) {
      thinking_part = reasoning_of(msg) + std::string(kThinkEnd);
    }
    prompt += thinking_part + text_or_empty(content, "assistant content") + tool_calls_text;
    const bool wo_eos = truthy(get(msg, "wo_eos")) || truthy(get(msg, "prefix"));
    if (!wo_eos) prompt += kEos;
  } else {
    DSV4_FAIL("chat message #{}: unknown role `{}` (expected system, developer, user, assistant, tool, "
              "latest_reminder)", index, role);
  }

  // The transition to the next turn, decided by what follows.
  if (index + 1 < static_cast<int>(messages.size())) {
    const Json& next_role = get(messages[index + 1], "role");
    if (next_role != "assistant" && next_role != "latest_reminder") return prompt;
  }
  const Json& task = get(msg, "task");
  if (!task.is_null()) {
    DSV4_CHECK(task.is_string() && task_tokens().count(task.get<std::string>()),
               "chat message #{}: invalid task {} (valid: action, query, authority, domain, title, read_url)", index,
               task.dump());
    const std::string& token = task_tokens().at(task.get<std::string>());
    if (task != "action") {
      prompt += token;
    } else {
      prompt += std::string(kAssistant) + std::string(thinking ? kThinkStart : kThinkEnd) + token;
    }
  } else if (role == "user" || role == "developer") {
    prompt += kAssistant;
    const bool open_thinking = thinking && (!drop_thinking || index >= last_user);
    prompt += open_thinking ? kThinkStart : kThinkEnd;
  }
  return prompt;
}

// Tool messages become tool_result blocks of a user message (joined with an adjacent user turn).
Json merge_tool_messages(const Json& messages) {
  Json merged = Json::array();
  for (const auto& msg : messages) {
    const Json& role = get(msg, "role");
    auto last_is_open_user = [&](bool require_no_task) {
      if (merged.empty()) return false;
      const Json& last = merged.back();
      return get(last, "role") == "user" && last.contains("content_blocks") &&
             (!require_no_task || get(last, "task").is_null());
    };
    if (role == "tool") {
      Json block = {{"type", "tool_result"},
                    {"tool_use_id", msg.contains("tool_call_id") ? msg["tool_call_id"] : Json("")},
                    {"content", msg.contains("content") ? msg["content"] : Json("")}};
      if (last_is_open_user(false)) {
        merged.back()["content_blocks"].push_back(std::move(block));
      } else {
        merged.push_back({{"role", "user"}, {"content_blocks", Json::array({std::move(block)})}});
      }
    } else if (role == "user") {
      const Json text = msg.contains("content") ? msg["content"] : Json("");
      Json block = {{"type", "text"}, {"text", text}};
      if (last_is_open_user(true)) {
        merged.back()["content_blocks"].push_back(std::move(block));
      } else {
        Json m = {{"role", "user"}, {"content", text}, {"content_blocks", Json::array({std::move(block)})}};
        for (const char* key : {"task", "wo_eos", "mask"}) {
          if (msg.contains(key)) m[key] = msg[key];
        }
        merged.push_back(std::move(m));
      }
    } else {
      merged.push_back(msg);
    }
  }
  return merged;
}

// Puts the tool_result blocks of each user turn in the order of the preceding assistant's calls.
void sort_tool_results(Json& messages) {
  std::map<std::string, int> order;
  for (auto& msg : messages) {
    const Json& role = get(msg, "role");
    if (role == "assistant" && truthy(get(msg, "tool_calls"))) {
      order.clear();
      int idx = 0;
      for (const auto& tc : msg["tool_calls"]) {
        Json id = get(tc, "id");
        if (!truthy(id)) id = get(get(tc, "function"), "id");
        if (truthy(id) && id.is_string()) order[id.get<std::string>()] = idx;
        ++idx;
      }
    } else if (role == "user" && truthy(get(msg, "content_blocks"))) {
      Json& blocks = msg["content_blocks"];
      std::vector<Json> tool_blocks;
      for (const auto& b : blocks) {
        if (get(b, "type") == "tool_result") tool_blocks.push_back(b);
      }
      if (tool_blocks.size() > 1 && !order.empty()) {
        auto rank = [&](const Json& b) {
          const Json& id = get(b, "tool_use_id");
          if (!id.is_string()) return 0;
          auto it = order.find(id.get<std::string>());
          return it == order.end() ? 0 : it->second;
        };
        std::stable_sort(tool_blocks.begin(), tool_blocks.end(),
                         [&](const Json& a, const Json& b) { return rank(a) < rank(b); });
        size_t k = 0;
        for (auto& b : blocks) {
          if (get(b, "type") == "tool_result") b = tool_blocks[k++];
        }
      }
    }
  }
}

// Drops reasoning (and developer turns) before the last user turn.
Json drop_thinking_messages(const Json& messages) {
  const int last_user = find_last_user_index(messages);
  Json out = Json::array();
  for (int i = 0; i < static_cast<int>(messages.size()); ++i) {
    const Json& msg = messages[i];
    const Json& role = get(msg, "role");
    const bool keep = role == "user" || role == "system" || role == "tool" || role == "latest_reminder" ||
                      role == "direct_search_results";
    if (keep || i >= last_user) {
      out.push_back(msg);
    } else if (role == "assistant") {
      Json m = msg;
      m.erase("reasoning_content");
      m.erase("reasoning");
      out.push_back(std::move(m));
    }
  }
  return out;
}

}  // namespace

std::string python_json_dumps(const nlohmann::ordered_json& value) {
  std::string out;
  dump(value, out);
  return out;
}

std::string format_chat_v4(const nlohmann::ordered_json& messages_in, const ChatFormatOptions& options,
                           const nlohmann::ordered_json& context_in) {
  DSV4_CHECK(messages_in.is_array(), "chat messages must be a JSON array, got {}", messages_in.type_name());
  Json context = context_in.is_null() ? Json::array() : context_in;
  DSV4_CHECK(context.is_array(), "chat context must be a JSON array, got {}", context.type_name());

  Json messages = messages_in;
  if (truthy(options.tools)) {
    const bool has_head = !messages.empty() && (get(messages[0], "role") == "system" ||
                                                get(messages[0], "role") == "developer");
    if (has_head) {
      messages[0]["tools"] = options.tools;
    } else {
      messages.insert(messages.begin(), Json{{"role", "system"}, {"tools", options.tools}});
    }
  }

  // As the reference: merge tool turns, then order tool results with the context's calls in view.
  messages = merge_tool_messages(messages);
  {
    Json all = context;
    for (const auto& m : messages) all.push_back(m);
    sort_tool_results(all);
    messages = Json(std::vector<Json>(all.begin() + static_cast<std::ptrdiff_t>(context.size()), all.end()));
  }
  if (!context.empty()) {
    context = merge_tool_messages(context);
    sort_tool_results(context);
  }
  Json full = context;
  for (const auto& m : messages) full.push_back(m);

  std::string prompt = options.add_bos && context.empty() ? std::string(kBos) : std::string();

  bool drop = options.drop_thinking;
  for (const auto& m : full) {
    if (truthy(get(m, "tools"))) drop = false;
  }
  size_t n_render = messages.size(), context_len = context.size();
  if (options.thinking_mode == ThinkingMode::kThinking && drop) {
    full = drop_thinking_messages(full);
    n_render = full.size() - drop_thinking_messages(context).size();
    context_len = full.size() - n_render;
  }
  for (size_t i = 0; i < n_render; ++i) {
    prompt += render_message(static_cast<int>(i + context_len), full, options.thinking_mode, drop,
                             options.reasoning_effort);
  }
  return prompt;
}


// ---- Decoder: completion text -> message (encoding_dsv4.py, parse_message_from_completion_text) ----

namespace {

struct Stop {
  size_t next;            // index after the matched stop (or text.size() when none matched)
  std::string_view text;  // what came before it
  int which;              // index into the stop list, -1 when none matched
};

// The reference's _read_until_stop: the earliest of the stops after `from` (on a tie, the first
// listed); without a match, the rest of the text.
Stop read_until(std::string_view text, size_t from, std::initializer_list<std::string_view> stops) {
  size_t best = std::string_view::npos;
  int which = -1, i = 0;
  for (std::string_view s : stops) {
    const size_t pos = text.find(s, from);
    if (pos != std::string_view::npos && (best == std::string_view::npos || pos < best)) best = pos, which = i;
    ++i;
  }
  if (which < 0) return {text.size(), text.substr(from), -1};
  return {best + std::data(stops)[which].size(), text.substr(from, best - from), which};
}

std::string shown(std::string_view s) {
  constexpr size_t kMax = 120;
  return s.size() <= kMax ? std::string(s) : std::string(s.substr(0, kMax)) + "...";
}

[[noreturn]] void parse_fail(const std::string& what) {
  DSV4_FAIL("DeepSeek-V4 completion: {}", what);
}

bool is_py_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// `^\s*name="(.*?)">\n$` (DOTALL) on what follows "<｜DSML｜invoke". Python's `$` also matches before
// a final newline, so `">\n\n` closes the tag too (the encoder writes that for a call without
// arguments).
std::string parse_invoke_name(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && is_py_space(s[i])) ++i;
  constexpr std::string_view kOpen = "name=\"";
  if (s.substr(i, kOpen.size()) == kOpen) {
    const size_t start = i + kOpen.size();
    for (std::string_view close : {std::string_view("\">\n\n"), std::string_view("\">\n")}) {
      if (s.size() >= start + close.size() && s.substr(s.size() - close.size()) == close) {
        return std::string(s.substr(start, s.size() - close.size() - start));
      }
    }
  }
  parse_fail(fmt::format("tool name format error: '{}'", shown(s)));
}

struct Param {
  std::string name;
  bool is_string;
  std::string value;
};

// `^ name="(.*?)" string="(true|false)">(.*?)<$` (DOTALL) on what lies between
// "<｜DSML｜parameter" and "/｜DSML｜parameter": the name ends at the first `" string="true|false">`.
Param parse_parameter(std::string_view s) {
  constexpr std::string_view kOpen = " name=\"";
  size_t end = std::string_view::npos;  // where the value ends: before the final "<" (or "<\n")
  if (s.size() >= 1 && s.back() == '<') end = s.size() - 1;
  else if (s.size() >= 2 && s.substr(s.size() - 2) == "<\n") end = s.size() - 2;
  if (end != std::string_view::npos && s.substr(0, kOpen.size()) == kOpen) {
    for (size_t pos = s.find("\" string=\"", kOpen.size()); pos != std::string_view::npos && pos < end;
         pos = s.find("\" string=\"", pos + 1)) {
      for (std::string_view flag : {std::string_view("true\">"), std::string_view("false\">")}) {
        const size_t at = pos + 10;  // past `" string="`
        if (s.substr(at, flag.size()) == flag && at + flag.size() <= end) {
          return {std::string(s.substr(kOpen.size(), pos - kOpen.size())), flag[0] == 't',
                  std::string(s.substr(at + flag.size(), end - at - flag.size()))};
        }
      }
    }
  }
  parse_fail(fmt::format("parameter format error: '{}'", shown(s)));
}

// The reference's decode_dsml_to_arguments: "{" + ", ".join(json(key) + ": " + value) + "}", where a
// string="true" value is JSON-quoted and any other value is taken as written.
std::string arguments_from_params(const std::vector<Param>& params) {
  std::string out = "{";
  for (size_t i = 0; i < params.size(); ++i) {
    if (i) out += ", ";
    out += python_json_dumps(Json(params[i].name)) + ": " +
           (params[i].is_string ? python_json_dumps(Json(params[i].value)) : params[i].value);
  }
  return out + "}";
}

// The DSML block after "\n\n<｜DSML｜tool_calls"; returns the index after "</｜DSML｜tool_calls>".
size_t parse_tool_calls(std::string_view text, size_t index, std::vector<ParsedToolCall>& calls) {
  const std::string d(kDsml);
  const std::string invoke_open = "<" + d + "invoke", invoke_close = "</" + d + "invoke";
  const std::string param_open = "<" + d + "parameter", param_close = "/" + d + "parameter";
  const std::string block_close = "</" + d + "tool_calls>";
  while (true) {
    Stop s = read_until(text, index, {invoke_open, block_close});
    if (s.text != ">\n") parse_fail(fmt::format("tool call format error: expected '>\\n' but got '{}'", shown(s.text)));
    if (s.which < 0) parse_fail("unterminated tool-call block (missing " + block_close + ")");
    index = s.next;
    if (s.which == 1) return index;

    s = read_until(text, index, {param_open, invoke_close});
    if (s.which < 0) parse_fail("unterminated invoke (missing " + invoke_close + ">)");
    ParsedToolCall call;
    call.name = parse_invoke_name(s.text);
    index = s.next;
    std::vector<Param> params;
    while (s.which == 0) {
      s = read_until(text, index, {param_close});
      if (s.which < 0) parse_fail("unterminated parameter (missing <" + param_close + ">)");
      Param p = parse_parameter(s.text);
      for (const auto& q : params) {
        if (q.name == p.name) parse_fail(fmt::format("duplicate parameter name: '{}'", p.name));
      }
      params.push_back(std::move(p));
      index = s.next;
      s = read_until(text, index, {param_open, invoke_close});
      if (s.text != ">\n") {
        parse_fail(fmt::format("parameter format error: expected '>\\n' but got '{}'", shown(s.text)));
      }
      if (s.which < 0) parse_fail("unterminated invoke (missing " + invoke_close + ">)");
      index = s.next;
    }
    call.arguments = arguments_from_params(params);
    calls.push_back(std::move(call));
  }
}

}  // namespace

nlohmann::ordered_json ParsedMessage::to_json() const {
  Json calls = Json::array();
  for (const auto& c : tool_calls) {
    calls.push_back({{"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  }
  return {{"role", "assistant"}, {"content", content}, {"reasoning_content", reasoning_content},
          {"tool_calls", std::move(calls)}};
}

ParsedMessage parse_completion_v4(std::string_view text, ThinkingMode mode) {
  ParsedMessage msg;
  const std::string tool_calls_start = "\n\n<" + std::string(kDsml) + "tool_calls";
  size_t index = 0;
  if (mode == ThinkingMode::kThinking) {
    const Stop s = read_until(text, index, {kThinkEnd, tool_calls_start});
    if (s.which != 0) parse_fail("invalid thinking format: missing </think>");
    msg.reasoning_content = std::string(s.text);
    index = s.next;
  }
  Stop s = read_until(text, index, {kEos, tool_calls_start});
  msg.content = std::string(s.text);
  index = s.next;
  if (s.which == 1) {
    index = parse_tool_calls(text, index, msg.tool_calls);
    s = read_until(text, index, {kEos});
    if (!s.text.empty()) parse_fail(fmt::format("unexpected content after tool calls: '{}'", shown(s.text)));
    index = s.next;
  } else if (s.which < 0) {
    parse_fail("invalid format: missing the end-of-sentence token");
  }
  if (index != text.size()) {
    parse_fail(fmt::format("unexpected content at end: '{}'", shown(text.substr(index))));
  }
  for (std::string_view sp : {kBos, kEos, kThinkStart, kThinkEnd, kDsml}) {
    if (msg.content.find(sp) != std::string::npos || msg.reasoning_content.find(sp) != std::string::npos) {
      parse_fail(fmt::format("unexpected special token '{}' in content", sp));
    }
  }
  return msg;
}

}  // namespace dsv4
