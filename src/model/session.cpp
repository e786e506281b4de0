// SPDX-License-Identifier: MIT
#include "model/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include <spdlog/spdlog.h>

#include "core/check.h"

namespace dsv4 {

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  DSV4_CHECK(params.temperature >= 0 && std::isfinite(params.temperature), "temperature must be >= 0, got {}",
             params.temperature);
  DSV4_CHECK(params.top_p > 0 && params.top_p <= 1, "top_p must be in (0, 1], got {}", params.top_p);
  DSV4_CHECK(params.top_k >= 0, "top_k must be >= 0, got {}", params.top_k);
}

int32_t Sampler::sample(std::span<const float> logits) {
  const int V = int(logits.size());
  if (params_.temperature == 0.0f) return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  const int k = params_.top_k > 0 ? std::min(params_.top_k, V) : V;
  std::vector<double> prob(k);
  const double mx = logits[order[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += (prob[i] = std::exp((logits[order[i]] - mx) / params_.temperature));
  int keep = k;
  double cumulative = 0;
  for (int i = 0; i < k; ++i) {
    cumulative += prob[i] / sum;
    if (cumulative >= params_.top_p) {
      keep = i + 1;
      break;
    }
  }
  std::discrete_distribution<int> pick(prob.begin(), prob.begin() + keep);
  return int32_t(order[pick(rng_)]);
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

  auto t0 = Clock::now();
  std::vector<float> logits = runner_.forward(prompt, !options.keep_logits);
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  auto keep = [&](std::span<const float> rows, int n_rows) {
    if (!options.keep_logits) return;
    result.logits.insert(result.logits.end(), rows.begin(), rows.end());
    result.logit_rows += n_rows;
  };
  keep(logits, int(logits.size() / V));
  std::span<const float> last(logits.data() + logits.size() - V, V);

  auto t1 = Clock::now();
  for (int i = 0; i < options.max_new_tokens; ++i) {
    const int32_t next = sampler.sample(last);
    result.output_ids.push_back(next);
    if (options.on_token) options.on_token(next);
    const bool is_eos = std::find(eos.begin(), eos.end(), next) != eos.end();
    if (i + 1 == options.max_new_tokens || (options.stop_at_eos && is_eos)) break;
    if (runner_.n_tokens() >= runner_.max_context()) {
      spdlog::warn("context of {} tokens is full; stopping after {} new tokens", runner_.max_context(), i + 1);
      break;
    }
    logits = runner_.forward(std::span<const int32_t>(&next, 1), true);
    ++result.decode_steps;
    keep(logits, 1);
    last = std::span<const float>(logits.data(), V);
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return result;
}

}  // namespace dsv4
