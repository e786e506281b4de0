// SPDX-License-Identifier: MIT
#include "server/openai_api.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <random>
#include <set>

#include "core/check.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/utf8.h"

namespace dsv4::server {

Json error_body(const ApiError& error) {
  Json e;
  e["message"] = error.what();
  e["type"] = error.type;
  e["param"] = error.param.empty() ? Json(nullptr) : Json(error.param);
  e["code"] = error.code.empty() ? Json(nullptr) : Json(error.code);
  return Json{{"error", e}};
}

std::string token_text(const Tokenizer& tokenizer, int32_t id) {
  std::string bytes;
  tokenizer.append_token_bytes(id, false, bytes);
  return utf8::sanitize(bytes);
}

namespace {

ApiError bad(const std::string& param, const std::string& message) { return ApiError(400, message, param); }

// Reads the fields of one JSON object; a null value counts as absent, as OpenAI's API treats it.
class Fields {
 public:
  Fields(const Json& object, std::string prefix = {}) : object_(object), prefix_(std::move(prefix)) {}

  void reject_unknown(const std::set<std::string>& known) const {
    for (const auto& [key, value] : object_.items())
      if (!known.count(key)) throw bad(prefix_ + key, fmt::format("Unrecognized request argument supplied: {}", key));
  }
  const Json* get(const std::string& key) const {
    const auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  std::string name(const std::string& key) const { return prefix_ + key; }

  double number(const std::string& key, double lo, double hi, double fallback) const {
    const Json* v = get(key);
    if (!v) return fallback;
    if (!v->is_number()) throw bad(name(key), fmt::format("'{}' must be a number", name(key)));
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) throw bad(name(key), fmt::format("'{}' must be between {} and {}, got {}", name(key), lo, hi, x));
    return x;
  }
  int64_t integer(const std::string& key, double lo, double hi, int64_t fallback) const {
    const Json* v = get(key);
    if (!v) return fallback;
    const bool integral = v->is_number_integer() || (v->is_number_float() && std::isfinite(v->get<double>()) &&
                                                     v->get<double>() == std::floor(v->get<double>()));
    if (!integral) throw bad(name(key), fmt::format("'{}' must be an integer", name(key)));
    const double x = v->is_number_unsigned() ? double(v->get<uint64_t>()) : v->get<double>();
    if (!(x >= lo && x <= hi))
      throw bad(name(key), fmt::format("'{}' must be between {} and {}, got {}", name(key), int64_t(lo), int64_t(hi), v->dump()));
    return v->is_number_unsigned() ? int64_t(v->get<uint64_t>()) : v->get<int64_t>();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const Json* v = get(key);
    if (!v) return fallback;
    if (!v->is_boolean()) throw bad(name(key), fmt::format("'{}' must be a boolean", name(key)));
    return v->get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    const Json* v = get(key);
    if (!v) return fallback;
    if (!v->is_string()) throw bad(name(key), fmt::format("'{}' must be a string", name(key)));
    return v->get<std::string>();
  }
  // Accepted for compatibility only at the value that means "off".
  void only_default(const std::string& key, const Json& off, const std::string& what) const {
    const Json* v = get(key);
    if (v && *v != off && !(v->is_number() && off.is_number() && v->get<double>() == off.get<double>()))
      throw bad(name(key), fmt::format("'{}' is not supported by this server ({})", name(key), what));
  }

 private:
  const Json& object_;
  std::string prefix_;
};

std::vector<std::string> parse_stop(const Fields& f) {
  const Json* v = f.get("stop");
  if (!v) return {};
  std::vector<std::string> stop;
  if (v->is_string()) {
    stop.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (v->size() > 4) throw bad("stop", "'stop' may hold at most 4 sequences");
    for (const Json& s : *v) {
      if (!s.is_string()) throw bad("stop", "'stop' must be a string or an array of strings");
      stop.push_back(s.get<std::string>());
    }
  } else {
    throw bad("stop", "'stop' must be a string or an array of strings");
  }
  for (const std::string& s : stop) {
    if (s.empty()) throw bad("stop", "'stop' sequences must not be empty");
    if (!utf8::is_valid(s)) throw bad("stop", "'stop' sequences must be valid UTF-8");
  }
  return stop;
}

// Chat content: a string, or an array of {"type": "text", "text": ...} parts (joined).
Json message_content(const Json& content, const std::string& where) {
  if (content.is_null() || content.is_string()) return content;
  if (!content.is_array()) throw bad(where, fmt::format("'{}' must be a string or an array of text parts", where));
  std::string text;
  for (const Json& part : content) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
      throw bad(where, fmt::format("'{}': only parts of type \"text\" with a string \"text\" are supported", where));
    text += part["text"].get<std::string>();
  }
  return text;
}

std::vector<int32_t> chat_prompt(const Json& messages, const ApiContext& context) {
  if (!messages.is_array() || messages.empty()) throw bad("messages", "'messages' must be a non-empty array");
  Json normalized = Json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string where = fmt::format("messages[{}]", i);
    const Json& m = messages[i];
    if (!m.is_object()) throw bad(where, fmt::format("'{}' must be an object", where));
    Fields(m, where + ".").reject_unknown(
        {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning"});
    if (!m.contains("role") || !m["role"].is_string())
      throw bad(where + ".role", fmt::format("'{}.role' is required and must be a string", where));
    const std::string role = m["role"].get<std::string>();
    static const std::set<std::string> roles = {"system", "developer", "user", "assistant", "tool"};
    if (!roles.count(role))
      throw bad(where + ".role", fmt::format("'{}.role' must be one of system, developer, user, assistant, tool; got "
                                             "\"{}\"", where, role));
    if (!m.contains("content") && role != "assistant")
      throw bad(where + ".content", fmt::format("'{}.content' is required", where));
    Json message = m;
    message["content"] = message_content(m.value("content", Json(nullptr)), where + ".content");
    if (message["content"].is_null() && role != "assistant")
      throw bad(where + ".content", fmt::format("'{}.content' must not be null", where));
    if (message["content"].is_string() && !utf8::is_valid(message["content"].get<std::string>()))
      throw bad(where + ".content", fmt::format("'{}.content' is not valid UTF-8", where));
    normalized.push_back(std::move(message));
  }
  ChatFormatOptions options;
  options.thinking_mode = ThinkingMode::kChat;
  std::string prompt;
  try {
    prompt = format_chat_v4(normalized, options);
  } catch (const Error& e) {
    throw bad("messages", e.what());
  }
  return context.tokenizer.encode(prompt, /*allow_special=*/true);
}

std::vector<int32_t> completion_prompt(const Json* prompt, const ApiContext& context) {
  if (!prompt) throw bad("prompt", "'prompt' is required");
  const Tokenizer& tok = context.tokenizer;
  auto from_text = [&](const std::string& text) {
    if (!utf8::is_valid(text)) throw bad("prompt", "'prompt' is not valid UTF-8");
    std::vector<int32_t> ids;
    if (tok.add_bos_token() && tok.bos_id()) ids.push_back(*tok.bos_id());  // as HF's add_special_tokens=True
    const std::vector<int32_t> body = tok.encode(text, /*allow_special=*/true);
    ids.insert(ids.end(), body.begin(), body.end());
    return ids;
  };
  auto from_ids = [&](const Json& array) {
    std::vector<int32_t> ids;
    for (const Json& id : array) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= context.vocab_size)
        throw bad("prompt", fmt::format("'prompt' token ids must be integers in [0, {})", context.vocab_size));
      ids.push_back(int32_t(id.get<int64_t>()));
    }
    return ids;
  };
  if (prompt->is_string()) return from_text(prompt->get<std::string>());
  if (!prompt->is_array() || prompt->empty())
    throw bad("prompt", "'prompt' must be a string, an array of token ids, or an array holding one of those");
  const Json& first = (*prompt)[0];
  if (first.is_number()) return from_ids(*prompt);
  if (prompt->size() > 1) throw bad("prompt", "only one prompt per request is supported");
  if (first.is_string()) return from_text(first.get<std::string>());
  if (first.is_array() && !first.empty()) return from_ids(first);
  throw bad("prompt", "'prompt' must be a string, an array of token ids, or an array holding one of those");
}

std::string random_id(const char* prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  return fmt::format("{}{:016x}{:08x}", prefix, rng(), uint32_t(rng()));
}

}  // namespace

ApiRequest parse_request(Endpoint endpoint, const Json& body, const ApiContext& context) {
  if (!body.is_object()) throw bad("", "the request body must be a JSON object");
  const bool chat = endpoint == Endpoint::kChatCompletions;
  const Fields f(body);
  std::set<std::string> known = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                                 "stop", "seed", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                                 "user", "top_k", "ignore_eos"};
  if (chat)
    known.insert({"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                  "response_format"});
  else
    known.insert({"prompt", "echo", "best_of", "suffix"});
  f.reject_unknown(known);

  const Json* model = f.get("model");
  if (!model || !model->is_string()) throw bad("model", "'model' is required and must be a string");
  if (model->get<std::string>() != context.model_name)
    throw ApiError(404, fmt::format("The model '{}' does not exist; this server serves '{}'", model->get<std::string>(),
                                    context.model_name),
                   "model", "invalid_request_error", "model_not_found");

  ApiRequest r{endpoint, {}, false, false, false};
  GenerationRequest& g = r.generation;
  f.only_default("n", 1, "n must be 1");
  f.only_default("presence_penalty", 0, "only 0");
  f.only_default("frequency_penalty", 0, "only 0");
  if (const Json* bias = f.get("logit_bias"); bias && !(bias->is_object() && bias->empty()))
    throw bad("logit_bias", "'logit_bias' is not supported by this server");
  if (chat) {
    if (const Json* tools = f.get("tools"); tools && !(tools->is_array() && tools->empty()))
      throw bad("tools", "'tools' is not supported by this server");
    f.only_default("tool_choice", "none", "no tools");
    f.only_default("response_format", Json{{"type", "text"}}, "text only");
    f.boolean("parallel_tool_calls", false);
  } else {
    f.only_default("echo", false, "echo must be false");
    f.only_default("best_of", 1, "best_of must be 1");
    f.only_default("suffix", "", "no suffix");
  }
  f.string("user", "");

  r.stream = f.boolean("stream", false);
  if (const Json* options = f.get("stream_options")) {
    if (!options->is_object()) throw bad("stream_options", "'stream_options' must be an object");
    if (!r.stream) throw bad("stream_options", "'stream_options' is only allowed when 'stream' is true");
    const Fields so(*options, "stream_options.");
    so.reject_unknown({"include_usage", "continuous_usage_stats"});
    r.include_usage = so.boolean("include_usage", false);
    so.boolean("continuous_usage_stats", false);
  }

  g.sampling.temperature = float(f.number("temperature", 0, 2, 1.0));
  g.sampling.top_p = float(f.number("top_p", 0, 1, 1.0));
  if (g.sampling.top_p <= 0) throw bad("top_p", "'top_p' must be greater than 0");
  const int64_t top_k = f.integer("top_k", -1, 1e9, 0);
  g.sampling.top_k = top_k < 0 ? 0 : int(top_k);  // -1 (vLLM) and 0 both mean no limit
  if (f.get("seed"))
    g.sampling.seed = uint64_t(f.integer("seed", -9.2e18, 9.2e18, 0));
  else
    g.sampling.seed = std::random_device{}() * 0x9E3779B97F4A7C15ull + std::random_device{}();
  g.stop = parse_stop(f);
  g.ignore_eos = f.boolean("ignore_eos", false);

  if (chat) {
    r.logprobs = f.boolean("logprobs", false);
    const int64_t top = f.integer("top_logprobs", 0, 20, -1);
    if (top >= 0 && !r.logprobs) throw bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true");
    g.top_logprobs = r.logprobs ? int(std::max<int64_t>(top, 0)) : -1;
  } else {
    const int64_t top = f.integer("logprobs", 0, 20, -1);
    r.logprobs = top >= 0;
    g.top_logprobs = int(top);
  }

  if (chat) {
    const Json* messages = f.get("messages");
    if (!messages) throw bad("messages", "'messages' is required");
    g.prompt = chat_prompt(*messages, context);
  } else {
    g.prompt = completion_prompt(f.get("prompt"), context);
  }
  if (g.prompt.empty()) throw bad("prompt", "the prompt is empty");

  const int64_t prompt_tokens = int64_t(g.prompt.size());
  std::string max_key = "max_tokens";
  if (chat && f.get("max_completion_tokens")) max_key = "max_completion_tokens";
  const int64_t asked = f.integer(max_key, 1, 1e15, -1);
  if (asked > context.max_context)
    throw bad(max_key, fmt::format("'{}' is too large: {}. This model supports at most {} tokens of context", max_key,
                                   asked, context.max_context));
  if (prompt_tokens >= context.max_context || (asked > 0 && prompt_tokens + asked > context.max_context))
    throw ApiError(400,
                   fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                               "({} in the {}, {} for the completion). Please reduce the length of the {} or of {}.",
                               context.max_context, prompt_tokens + std::max<int64_t>(asked, 0), prompt_tokens,
                               chat ? "messages" : "prompt", std::max<int64_t>(asked, 0), chat ? "messages" : "prompt",
                               max_key),
                   chat ? "messages" : "prompt", "invalid_request_error", "context_length_exceeded");
  const int64_t room = context.max_context - prompt_tokens;
  // Without max_tokens, chat runs to the end of the context (OpenAI's behaviour), completions stop at 16.
  g.max_tokens = int(asked > 0 ? asked : std::min<int64_t>(chat ? room : 16, room));
  return r;
}

ResponseBuilder::ResponseBuilder(const ApiRequest& request, const ApiContext& context)
    : context_(context), endpoint_(request.endpoint), logprobs_(request.logprobs),
      include_usage_(request.include_usage), prompt_tokens_(int(request.generation.prompt.size())),
      id_(random_id(request.endpoint == Endpoint::kChatCompletions ? "chatcmpl-" : "cmpl-")),
      created_(std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch())
                   .count()) {}

Json ResponseBuilder::usage() const {
  return Json{{"prompt_tokens", prompt_tokens_}, {"completion_tokens", completion_tokens_},
              {"total_tokens", prompt_tokens_ + completion_tokens_}};
}

Json ResponseBuilder::logprobs_json(const std::vector<GeneratedToken>& tokens, size_t text_offset) const {
  const Tokenizer& tok = context_.tokenizer;
  if (endpoint_ == Endpoint::kChatCompletions) {
    auto entry = [&](int32_t id, float logprob) {
      std::string bytes;
      tok.append_token_bytes(id, false, bytes);
      Json b = Json::array();
      for (unsigned char c : bytes) b.push_back(int(c));
      return Json{{"token", utf8::sanitize(bytes)}, {"logprob", logprob}, {"bytes", b}};
    };
    Json content = Json::array();
    for (const GeneratedToken& t : tokens) {
      Json e = entry(t.id, t.logprob);
      Json top = Json::array();
      for (const TokenLogprob& alt : t.top) top.push_back(entry(alt.id, alt.logprob));
      e["top_logprobs"] = top;
      content.push_back(e);
    }
    return Json{{"content", content}, {"refusal", nullptr}};
  }
  Json out{{"tokens", Json::array()}, {"token_logprobs", Json::array()}, {"top_logprobs", Json::array()},
           {"text_offset", Json::array()}};
  for (const GeneratedToken& t : tokens) {
    const std::string text = token_text(tok, t.id);
    out["tokens"].push_back(text);
    out["token_logprobs"].push_back(t.logprob);
    Json top = Json::object();
    for (const TokenLogprob& alt : t.top) top[token_text(tok, alt.id)] = alt.logprob;
    top[text] = t.logprob;  // the chosen token is always listed (up to logprobs + 1 entries, as vLLM does)
    out["top_logprobs"].push_back(top);
    out["text_offset"].push_back(text_offset);
    text_offset += text.size();
  }
  return out;
}

Json ResponseBuilder::chunk(Json choice) const {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  Json c{{"id", id_}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created_},
         {"model", context_.model_name}, {"choices", Json::array({std::move(choice)})}};
  if (include_usage_) c["usage"] = nullptr;
  return c;
}

namespace {
std::string sse(const Json& data) { return "data: " + data.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n\n"; }
}  // namespace

std::string ResponseBuilder::stream_start() const {
  if (endpoint_ != Endpoint::kChatCompletions) return {};
  return sse(chunk(Json{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                        {"finish_reason", nullptr}}));
}

std::string ResponseBuilder::stream_event(const StreamEvent& event) {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  const size_t offset = text_.size();
  add(event);
  if (!error_.empty())
    return sse(error_body(ApiError(500, error_, {}, event.finish == FinishReason::kCancelled ? "cancelled" : "server_error")));
  std::string out;
  if (!event.text.empty() || (logprobs_ && !event.tokens.empty())) {
    Json choice{{"index", 0}};
    if (chat)
      choice["delta"] = Json{{"content", event.text}};
    else
      choice["text"] = event.text;
    choice["logprobs"] = logprobs_ ? logprobs_json(event.tokens, offset) : Json(nullptr);
    choice["finish_reason"] = nullptr;
    out += sse(chunk(std::move(choice)));
  }
  if (event.finish) {
    Json choice{{"index", 0}};
    if (chat)
      choice["delta"] = Json::object();
    else
      choice["text"] = "";
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = finish_reason_;
    out += sse(chunk(std::move(choice)));
  }
  return out;
}

std::string ResponseBuilder::stream_end() const {
  std::string out;
  if (include_usage_ && error_.empty()) {
    const bool chat = endpoint_ == Endpoint::kChatCompletions;
    out += sse(Json{{"id", id_}, {"object", chat ? "chat.completion.chunk" : "text_completion"}, {"created", created_},
                    {"model", context_.model_name}, {"choices", Json::array()}, {"usage", usage()}});
  }
  return out + "data: [DONE]\n\n";
}

void ResponseBuilder::add(const StreamEvent& event) {
  text_ += event.text;
  tokens_.insert(tokens_.end(), event.tokens.begin(), event.tokens.end());
  completion_tokens_ = std::max(completion_tokens_, event.completion_tokens);
  if (event.finish) {
    finish_reason_ = finish_reason_name(*event.finish);
    if (*event.finish == FinishReason::kError) error_ = event.error.empty() ? "generation failed" : event.error;
    if (*event.finish == FinishReason::kCancelled) error_ = "the request was cancelled";
  }
}

Json ResponseBuilder::response() const {
  Json choice{{"index", 0}};
  if (endpoint_ == Endpoint::kChatCompletions)
    choice["message"] = Json{{"role", "assistant"}, {"content", text_}};
  else
    choice["text"] = text_;
  choice["logprobs"] = logprobs_ ? logprobs_json(tokens_, 0) : Json(nullptr);
  choice["finish_reason"] = finish_reason_;
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  return Json{{"id", id_}, {"object", chat ? "chat.completion" : "text_completion"}, {"created", created_},
              {"model", context_.model_name}, {"choices", Json::array({std::move(choice)})}, {"usage", usage()}};
}

}  // namespace dsv4::server
