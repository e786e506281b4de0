// SPDX-License-Identifier: MIT
// The OpenAI wire format, apart from HTTP: request JSON -> GenerationRequest (validated, tokenised, checked
// against the context), and engine events -> response JSON / Server-Sent Events chunks. Every refusal is an
// ApiError carrying the HTTP status and OpenAI's error fields.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

using Json = nlohmann::ordered_json;

struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = {},
           std::string type = "invalid_request_error", std::string code = {})
      : std::runtime_error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
};

// {"error": {"message", "type", "param", "code"}}
Json error_body(const ApiError& error);

enum class Endpoint { kCompletions, kChatCompletions };

struct ApiContext {
  const Tokenizer& tokenizer;
  std::string model_name;  // the one id /v1/models lists
  int max_context;         // prompt + completion tokens per request
  int vocab_size;          // of the model: prompt token ids must be below it
};

struct ApiRequest {
  Endpoint endpoint;
  GenerationRequest generation;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with usage and no choices
  bool logprobs = false;
};

// Validates a request body (already parsed JSON). Throws ApiError: 400 for bad fields (naming the field), 404
// for another model, 400 with code context_length_exceeded when prompt + max_tokens exceed the context.
ApiRequest parse_request(Endpoint endpoint, const Json& body, const ApiContext& context);

// Builds the responses of one request from its engine events. The context must outlive it.
class ResponseBuilder {
 public:
  ResponseBuilder(const ApiRequest& request, const ApiContext& context);

  // Streaming: the SSE text ("data: ...\n\n" lines) to send for the start, each event, and the end.
  std::string stream_start() const;
  std::string stream_event(const StreamEvent& event);
  std::string stream_end() const;

  // Non-streaming: fold events in, then render the whole response.
  void add(const StreamEvent& event);
  Json response() const;

  const std::string& id() const { return id_; }
  // Non-empty when the request ended in an engine error or was cancelled.
  const std::string& error() const { return error_; }

 private:
  Json chunk(Json choice) const;
  Json logprobs_json(const std::vector<GeneratedToken>& tokens, size_t text_offset) const;
  Json usage() const;

  const ApiContext& context_;
  Endpoint endpoint_;
  bool logprobs_, include_usage_;
  int prompt_tokens_;
  std::string id_;
  int64_t created_;
  std::string text_;
  std::vector<GeneratedToken> tokens_;
  std::string finish_reason_;
  std::string error_;
  int completion_tokens_ = 0;
};

// The text of a token for logprobs: its bytes, repaired to valid UTF-8.
std::string token_text(const Tokenizer& tokenizer, int32_t id);

}  // namespace dsv4::server
