// SPDX-License-Identifier: MIT
// OpenAI request validation and response shapes, without HTTP (tests/server/*.sh and tools/server-tests cover the
// same over real sockets).
#include <gtest/gtest.h>

#include <filesystem>

#include "server/openai_api.h"

namespace fs = std::filesystem;
using namespace dsv4;
using namespace dsv4::server;

namespace {

const Tokenizer& tokenizer() {
  static const Tokenizer t = Tokenizer::load((fs::path(DSV4_SOURCE_DIR) / "models" / "tiny").string());
  return t;
}

ApiContext context(int max_context = 64) { return ApiContext{tokenizer(), "tiny", max_context, 1028}; }

Json chat(Json extra = Json::object()) {
  Json body{{"model", "tiny"}, {"messages", Json::array({Json{{"role", "user"}, {"content", "Hi"}}})}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

Json completion(Json extra = Json::object()) {
  Json body{{"model", "tiny"}, {"prompt", "Hello"}};
  for (auto& [k, v] : extra.items()) body[k] = v;
  return body;
}

// Expects parse_request to refuse body with `status`, naming `param`.
void expect_refused(Endpoint endpoint, const Json& body, int status, const std::string& param,
                    const std::string& code = {}) {
  try {
    parse_request(endpoint, body, context());
    ADD_FAILURE() << "accepted: " << body.dump();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, status) << body.dump() << ": " << e.what();
    EXPECT_EQ(e.param, param) << body.dump() << ": " << e.what();
    if (!code.empty()) EXPECT_EQ(e.code, code) << e.what();
    const Json b = error_body(e);
    EXPECT_TRUE(b["error"]["message"].is_string());
    EXPECT_TRUE(b["error"]["type"].is_string());
  }
}

}  // namespace

TEST(OpenAiApi, ChatDefaultsAndPrompt) {
  const ApiRequest r = parse_request(Endpoint::kChatCompletions, chat(), context());
  // BOS <｜User｜> Hi <｜Assistant｜> </think>: DeepSeek-V4 chat mode.
  EXPECT_EQ(r.generation.prompt, (std::vector<int32_t>{0, 1024, 42, 75, 1025, 1027}));
  EXPECT_EQ(r.generation.max_tokens, 64 - 6);  // no max_tokens: up to the end of the context
  EXPECT_FLOAT_EQ(r.generation.sampling.temperature, 1.0f);
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.generation.top_logprobs, -1);
}

TEST(OpenAiApi, CompletionPromptForms) {
  auto prompt_of = [](Json prompt) {
    return parse_request(Endpoint::kCompletions, completion({{"prompt", prompt}}), context()).generation.prompt;
  };
  const std::vector<int32_t> hello = {0, 42, 574, 81};  // BOS + "Hello" (add_bos_token)
  EXPECT_EQ(prompt_of("Hello"), hello);
  EXPECT_EQ(prompt_of(Json::array({"Hello"})), hello);
  EXPECT_EQ(prompt_of(Json::array({5, 6, 7})), (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(prompt_of(Json::array({Json::array({5, 6})})), (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(prompt_of(""), std::vector<int32_t>{0});
  EXPECT_EQ(parse_request(Endpoint::kCompletions, completion(), context()).generation.max_tokens, 16);
}

TEST(OpenAiApi, ParametersAreRead) {
  const ApiRequest r = parse_request(
      Endpoint::kChatCompletions,
      chat({{"max_tokens", 7}, {"temperature", 0}, {"top_p", 0.5}, {"seed", 42}, {"stop", "x"}, {"stream", true},
            {"stream_options", {{"include_usage", true}}}, {"logprobs", true}, {"top_logprobs", 3}, {"n", 1},
            {"user", "u"}, {"top_k", 5}}),
      context());
  EXPECT_EQ(r.generation.max_tokens, 7);
  EXPECT_EQ(r.generation.sampling.temperature, 0.0f);
  EXPECT_EQ(r.generation.sampling.top_p, 0.5f);
  EXPECT_EQ(r.generation.sampling.seed, 42u);
  EXPECT_EQ(r.generation.sampling.top_k, 5);
  EXPECT_EQ(r.generation.stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(r.stream && r.include_usage && r.logprobs);
  EXPECT_EQ(r.generation.top_logprobs, 3);
  const ApiRequest c = parse_request(Endpoint::kCompletions, completion({{"logprobs", 0}, {"max_tokens", 3.0}}),
                                     context());
  EXPECT_EQ(c.generation.top_logprobs, 0);
  EXPECT_EQ(c.generation.max_tokens, 3);
}

TEST(OpenAiApi, BadRequestsNameTheField) {
  const auto kChat = Endpoint::kChatCompletions;
  const auto kText = Endpoint::kCompletions;
  expect_refused(kChat, Json::array(), 400, "");
  expect_refused(kChat, chat({{"bogus", 1}}), 400, "bogus");
  expect_refused(kChat, Json{{"model", "tiny"}}, 400, "messages");
  expect_refused(kChat, chat({{"messages", Json::array()}}), 400, "messages");
  expect_refused(kChat, chat({{"messages", "hi"}}), 400, "messages");
  expect_refused(kChat, chat({{"messages", Json::array({Json{{"content", "x"}}})}}), 400, "messages[0].role");
  expect_refused(kChat, chat({{"messages", Json::array({Json{{"role", "wizard"}, {"content", "x"}}})}}), 400,
                 "messages[0].role");
  expect_refused(kChat, chat({{"messages", Json::array({Json{{"role", "user"}}})}}), 400, "messages[0].content");
  expect_refused(kChat, chat({{"messages", Json::array({Json{{"role", "user"}, {"content", 5}}})}}), 400,
                 "messages[0].content");
  expect_refused(kChat, chat({{"messages", Json::array({Json{{"role", "user"}, {"content", "x"}, {"x", 1}}})}}), 400,
                 "messages[0].x");
  expect_refused(kChat, Json{{"messages", chat()["messages"]}}, 400, "model");
  expect_refused(kChat, chat({{"model", "gpt-4"}}), 404, "model", "model_not_found");
  expect_refused(kChat, chat({{"temperature", -1}}), 400, "temperature");
  expect_refused(kChat, chat({{"temperature", 1e9}}), 400, "temperature");
  expect_refused(kChat, chat({{"temperature", "hot"}}), 400, "temperature");
  expect_refused(kChat, chat({{"top_p", 0}}), 400, "top_p");
  expect_refused(kChat, chat({{"top_p", 1.5}}), 400, "top_p");
  expect_refused(kChat, chat({{"max_tokens", 0}}), 400, "max_tokens");
  expect_refused(kChat, chat({{"max_tokens", -5}}), 400, "max_tokens");
  expect_refused(kChat, chat({{"max_tokens", 2.5}}), 400, "max_tokens");
  expect_refused(kChat, chat({{"max_tokens", 1e300}}), 400, "max_tokens");
  expect_refused(kChat, chat({{"max_tokens", 100000}}), 400, "max_tokens");
  expect_refused(kChat, chat({{"max_tokens", 60}}), 400, "messages", "context_length_exceeded");  // 6 + 60 > 64
  expect_refused(kChat, chat({{"n", 2}}), 400, "n");
  expect_refused(kChat, chat({{"stop", 5}}), 400, "stop");
  expect_refused(kChat, chat({{"stop", Json::array({"a", "b", "c", "d", "e"})}}), 400, "stop");
  expect_refused(kChat, chat({{"stop", ""}}), 400, "stop");
  expect_refused(kChat, chat({{"seed", "x"}}), 400, "seed");
  expect_refused(kChat, chat({{"top_logprobs", 3}}), 400, "top_logprobs");
  expect_refused(kChat, chat({{"logprobs", true}, {"top_logprobs", 21}}), 400, "top_logprobs");
  expect_refused(kChat, chat({{"stream", "yes"}}), 400, "stream");
  expect_refused(kChat, chat({{"stream_options", {{"include_usage", true}}}}), 400, "stream_options");
  expect_refused(kChat, chat({{"presence_penalty", 0.5}}), 400, "presence_penalty");
  expect_refused(kChat, chat({{"tools", Json::array({Json{{"type", "function"}}})}}), 400, "tools");
  expect_refused(kText, completion({{"prompt", nullptr}}), 400, "prompt");
  expect_refused(kText, completion({{"prompt", Json::array({"a", "b"})}}), 400, "prompt");
  expect_refused(kText, completion({{"prompt", Json::array({1, 99999})}}), 400, "prompt");
  expect_refused(kText, completion({{"prompt", Json::array({-1})}}), 400, "prompt");
  expect_refused(kText, completion({{"prompt", std::string(200, 'x') + " long"}}), 400, "prompt",
                 "context_length_exceeded");
  expect_refused(kText, completion({{"logprobs", 50}}), 400, "logprobs");
  expect_refused(kText, completion({{"echo", true}}), 400, "echo");
  expect_refused(kText, completion({{"messages", chat()["messages"]}}), 400, "messages");
  expect_refused(kText, completion({{"prompt", "\xff\xfe"}}), 400, "prompt");
}

TEST(OpenAiApi, ResponsesHaveTheOpenAiShape) {
  const ApiContext ctx = context();  // the builders keep a reference to it
  const ApiRequest r =
      parse_request(Endpoint::kChatCompletions,
                    chat({{"stream", true}, {"stream_options", {{"include_usage", true}}}, {"logprobs", true}}),
                    ctx);
  ResponseBuilder b(r, ctx);
  StreamEvent e1;
  e1.text = "Hel";
  e1.tokens = {{42, -0.5f, {}}};
  e1.completion_tokens = 1;
  StreamEvent e2;
  e2.text = "lo";
  e2.tokens = {{574, -1.5f, {}}};
  e2.finish = FinishReason::kStop;
  e2.completion_tokens = 2;
  std::string sse = b.stream_start();
  sse += b.stream_event(e1);
  sse += b.stream_event(e2);
  sse += b.stream_end();
  std::vector<Json> chunks;
  for (size_t at = 0; (at = sse.find("data: ", at)) != std::string::npos;) {
    const size_t end = sse.find("\n\n", at);
    const std::string data = sse.substr(at + 6, end - at - 6);
    if (data != "[DONE]") chunks.push_back(Json::parse(data));
    at = end;
  }
  ASSERT_EQ(chunks.size(), 5u);  // role, "Hel", "lo", finish, usage
  EXPECT_TRUE(sse.ends_with("data: [DONE]\n\n"));
  EXPECT_EQ(chunks[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(chunks[1]["object"], "chat.completion.chunk");
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["content"], "Hel");
  EXPECT_EQ(chunks[1]["choices"][0]["logprobs"]["content"][0]["token"], "H");  // id 42
  EXPECT_EQ(chunks[1]["choices"][0]["logprobs"]["content"][0]["bytes"], Json::array({72}));
  EXPECT_FLOAT_EQ(chunks[1]["choices"][0]["logprobs"]["content"][0]["logprob"].get<float>(), -0.5f);
  EXPECT_EQ(chunks[3]["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(chunks[4]["choices"].empty());
  EXPECT_EQ(chunks[4]["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(chunks[4]["usage"]["completion_tokens"], 2);
  EXPECT_EQ(chunks[4]["usage"]["total_tokens"], 8);
  for (const Json& c : chunks) EXPECT_EQ(c["id"], chunks[0]["id"]);

  ResponseBuilder whole(r, ctx);
  whole.add(e1);
  whole.add(e2);
  const Json resp = whole.response();
  EXPECT_EQ(resp["object"], "chat.completion");
  EXPECT_EQ(resp["choices"][0]["message"]["content"], "Hello");
  EXPECT_EQ(resp["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(resp["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(resp["choices"][0]["logprobs"]["content"].size(), 2u);
  EXPECT_EQ(resp["usage"]["completion_tokens"], 2);
}
