// SPDX-License-Identifier: MIT
// `dsv4 chat`: an interactive terminal chat. Each line read from stdin is a user turn; the reply
// streams as it is generated. The prompt is always the DeepSeek-V4 chat format of the whole
// conversation (tokenizer/chat_format.h). When it extends what the sequence state already holds
// (chat mode), only the new tokens are prefilled; when it does not (thinking mode drops earlier
// reasoning, exactly as the reference encoder does), the state is reset and the prompt prefilled
// again. Commands: /reset starts over, /exit (or end of input) quits.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "core/check.h"
#include "model/session.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {
namespace {

struct ChatArgs {
  EngineOptions engine = EngineOptions::with_max_context(16384);
  SamplingParams sampling;
  SpeculateOptions speculate;
  std::string tokenizer, system, effort;
  int max_new_tokens = 2048;
  bool no_think = false;
};

// Splits a finished reply "reasoning</think>content" (thinking mode) into the message fields.
nlohmann::ordered_json assistant_message(const std::string& reply, bool thinking) {
  nlohmann::ordered_json m = {{"role", "assistant"}};
  const size_t end_think = thinking ? reply.find("</think>") : std::string::npos;
  if (end_think == std::string::npos) {
    m["reasoning_content"] = thinking ? reply : "";
    m["content"] = thinking ? "" : reply;
  } else {
    m["reasoning_content"] = reply.substr(0, end_think);
    m["content"] = reply.substr(end_think + 8);
  }
  return m;
}

int run_chat(const ChatArgs& a) {
  const Tokenizer tokenizer = Tokenizer::load(a.tokenizer.empty() ? a.engine.model_dir : a.tokenizer);
  const std::optional<int32_t> eos = tokenizer.eos_id();
  const Model model = load_model(a.engine);
  std::unique_ptr<SequenceRunner> runner = runner_factory(model, a.engine)(a.engine.max_context);
  Session session(*runner);

  ChatFormatOptions format;
  format.thinking_mode = a.no_think ? ThinkingMode::kChat : ThinkingMode::kThinking;
  format.reasoning_effort = a.effort == "max" ? ReasoningEffort::kMax
                            : a.effort == "high" ? ReasoningEffort::kHigh
                                                 : ReasoningEffort::kDefault;
  nlohmann::ordered_json history = nlohmann::ordered_json::array();
  if (!a.system.empty()) history.push_back({{"role", "system"}, {"content", a.system}});
  const nlohmann::ordered_json initial_history = history;

  std::vector<int32_t> in_state;      // ids the sequence state holds
  std::optional<int32_t> last_token;  // generated but not fed back yet (Session's contract)

  std::fprintf(stderr, "dsv4 chat (%s mode). /reset starts over, /exit or Ctrl-D quits.\n",
               a.no_think ? "chat" : "thinking");
  std::string line;
  while (true) {
    std::fputs("> ", stdout);
    std::fflush(stdout);
    if (!std::getline(std::cin, line) || line == "/exit") break;
    if (line == "/reset") {
      history = initial_history;
      session.reset();
      in_state.clear();
      last_token.reset();
      continue;
    }
    if (line.empty()) continue;
    history.push_back({{"role", "user"}, {"content", line}});
    const std::vector<int32_t> prompt = tokenizer.encode(format_chat_v4(history, format));

    // Feed only what the state lacks when the new prompt extends it; otherwise start over.
    std::vector<int32_t> held = in_state;
    if (last_token) held.push_back(*last_token);
    std::vector<int32_t> feed;
    if (!held.empty() && prompt.size() > held.size() && std::equal(held.begin(), held.end(), prompt.begin())) {
      feed.assign(prompt.begin() + static_cast<std::ptrdiff_t>(in_state.size()), prompt.end());
    } else {
      session.reset();
      in_state.clear();
      feed = prompt;
    }
    DSV4_CHECK(in_state.size() + feed.size() + a.max_new_tokens <= static_cast<size_t>(a.engine.max_context),
               "the conversation ({} tokens) plus --max-new-tokens {} exceeds --max-context {}; use /reset",
               in_state.size() + feed.size(), a.max_new_tokens, a.engine.max_context);

    StreamDecoder stream(tokenizer, /*skip_special=*/true);
    GenerateOptions options;
    options.max_new_tokens = a.max_new_tokens;
    options.sampling = a.sampling;
    options.speculate = a.speculate;
    options.on_token = [&](int32_t id) {
      std::fputs(stream.push(id).c_str(), stdout);
      std::fflush(stdout);
    };
    const GenerateResult r = session.generate(feed, options);
    std::printf("%s\n", stream.finish().c_str());
    spdlog::debug("prefill {} tokens in {:.2f} s, {} decode steps in {:.2f} s", feed.size(), r.prefill_seconds,
                  r.decode_steps, r.decode_seconds);

    in_state.insert(in_state.end(), feed.begin(), feed.end());
    std::vector<int32_t> reply_ids = r.output_ids;
    if (!r.output_ids.empty()) {
      in_state.insert(in_state.end(), r.output_ids.begin(), r.output_ids.end() - 1);
      last_token = r.output_ids.back();
    } else {
      last_token.reset();
    }
    if (!reply_ids.empty() && eos && reply_ids.back() == *eos) reply_ids.pop_back();
    // The format closes the turn with EOS; a reply cut at --max-new-tokens was never closed, so
    // the prefix check above sends the next turn through a full prefill.
    history.push_back(assistant_message(tokenizer.decode(reply_ids), !a.no_think));
  }
  std::fputc('\n', stdout);
  return 0;
}

}  // namespace

void add_chat_command(CLI::App& app, Handler& handler) {
  auto args = std::make_shared<ChatArgs>();
  CLI::App* cmd = app.add_subcommand("chat", "Interactive chat in the terminal (DeepSeek-V4 chat format, streamed)");
  add_engine_options(cmd, args->engine);
  cmd->add_option("--tokenizer", args->tokenizer, "tokenizer.json or directory (default: the model directory)");
  cmd->add_option("--system", args->system, "System prompt");
  cmd->add_flag("--no-think", args->no_think, "Chat mode: answer directly instead of reasoning in <think> first");
  cmd->add_option("--reasoning-effort", args->effort, "Thinking mode effort: high or max (max adds a preamble)")
      ->check(CLI::IsMember({"high", "max"}));
  cmd->add_option("--max-new-tokens", args->max_new_tokens, "Tokens per reply at most")
      ->capture_default_str()->check(CLI::PositiveNumber);
  add_sampling_options(cmd, args->sampling);
  add_speculate_options(cmd, args->speculate);
  cmd->callback([&handler, args] {
    args->engine.with_mtp = args->speculate.method == DraftMethod::Mtp;
    handler = [args] { return run_chat(*args); };
  });
}

}  // namespace dsv4::cli
