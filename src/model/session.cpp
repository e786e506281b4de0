// SPDX-License-Identifier: MIT
#include "model/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include <spdlog/spdlog.h>

#include "core/check.h"

namespace dsv4 {

int32_t SequenceRunner::forward_draw(std::span<const int32_t> tokens, const TokenDraw& draw) {
  const std::vector<float> logits = forward(tokens, true);
  return draw_token(logits, draw);
}

namespace {

class CpuRunner final : public SequenceRunner {
 public:
  CpuRunner(const Model& model, int max_context) : model_(model), state_(model.new_sequence(max_context)) {}
  const ModelConfig& config() const override { return model_.config(); }
  std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) override {
    return model_.forward(state_, tokens, last_only);
  }
  int64_t n_tokens() const override { return state_.n_tokens; }
  int max_context() const override { return state_.max_context; }
  void reset() override { state_.reset(); }
  size_t state_bytes() const override { return state_.bytes(); }

 private:
  const Model& model_;
  SequenceState state_;
};

}  // namespace

std::unique_ptr<SequenceRunner> make_cpu_runner(const Model& model, int max_context) {
  return std::make_unique<CpuRunner>(model, max_context);
}

GenerateResult Session::generate(std::span<const int32_t> prompt, const GenerateOptions& options) {
  using Clock = std::chrono::steady_clock;
  DSV4_CHECK(!prompt.empty(), "the prompt is empty");
  DSV4_CHECK(options.max_new_tokens >= 0, "max_new_tokens must be >= 0, got {}", options.max_new_tokens);
  const int V = runner_.config().vocab_size;
  DSV4_CHECK(runner_.n_tokens() + int64_t(prompt.size()) <= runner_.max_context(),
             "the prompt ({} tokens, {} already in the sequence) is longer than the context of {} tokens "
             "(--max-context)", prompt.size(), runner_.n_tokens(), runner_.max_context());
  GenerateResult result;
  Sampler sampler(options.sampling);
  const auto& eos = runner_.config().eos_token_ids;

  auto keep = [&](std::span<const float> rows, int n_rows) {
    if (!options.keep_logits) return;
    result.logits.insert(result.logits.end(), rows.begin(), rows.end());
    result.logit_rows += n_rows;
  };
  // Without kept logits the runner draws each token itself (a backend may do it on the device and bring back only
  // the id); the sampler's generator advances the same way on both paths, so a seed gives the same tokens.
  const bool runner_draws = !options.keep_logits && options.max_new_tokens > 0;
  std::vector<float> logits;
  int32_t next = -1;
  auto t0 = Clock::now();
  if (runner_draws) {
    next = runner_.forward_draw(prompt, sampler.next_draw(V));
  } else {
    logits = runner_.forward(prompt, !options.keep_logits);
    keep(logits, int(logits.size() / V));
  }
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  auto t1 = Clock::now();
  for (int i = 0; i < options.max_new_tokens; ++i) {
    if (!runner_draws) next = sampler.sample(std::span<const float>(logits.data() + logits.size() - V, V));
    result.output_ids.push_back(next);
    if (options.on_token) options.on_token(next);
    const bool is_eos = std::find(eos.begin(), eos.end(), next) != eos.end();
    if (i + 1 == options.max_new_tokens || (options.stop_at_eos && is_eos)) break;
    if (runner_.n_tokens() >= runner_.max_context()) {
      spdlog::warn("context of {} tokens is full; stopping after {} new tokens", runner_.max_context(), i + 1);
      break;
    }
    const int32_t fed = next;
    if (runner_draws) {
      next = runner_.forward_draw(std::span<const int32_t>(&fed, 1), sampler.next_draw(V));
    } else {
      logits = runner_.forward(std::span<const int32_t>(&fed, 1), true);
      keep(logits, 1);
    }
    ++result.decode_steps;
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return result;
}

}  // namespace dsv4
