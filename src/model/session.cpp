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

// Exact sampling without sorting the vocabulary (a full sort of 129K ids took ~20 ms per token on one core, more
// than a GPU decode step). "Before" is the order the nucleus is taken in: higher logit first, lower id among
// equal logits.
//   top_k < V: the k best ids by nth_element + sort, then the nucleus among them (the order and sums of the full
//     sort);
//   no top_k, top_p < 1: the total over all ids, then sorted prefixes of growing length until one reaches top_p;
//   no top_k, top_p = 1: every id, weighed in id order (no order is needed to draw from the whole distribution).
// Weights are computed in float (exp of (logit - max) / temperature) and summed in double.
int32_t Sampler::sample(std::span<const float> logits) {
  const int V = int(logits.size());
  DSV4_CHECK(V > 0, "sample: empty logits");
  if (params_.temperature == 0.0f) return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  auto before = [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const float mx = *std::max_element(logits.begin(), logits.end()), inv_t = 1.0f / params_.temperature;
  auto weight = [&](int id) { return double(std::exp((logits[id] - mx) * inv_t)); };
  // order_[0, n): the n first ids in "before" order. Few: one pass with a heap of the n best so far (most ids lose
  // one comparison against its worst); many: nth_element over all ids.
  auto sort_prefix = [&](int n) {
    if (n <= 1024) {
      order_.clear();
      for (int id = 0; id < V; ++id) {
        if (int(order_.size()) < n) {
          order_.push_back(id);
          std::push_heap(order_.begin(), order_.end(), before);  // the worst kept id on top
        } else if (before(id, order_.front())) {
          std::pop_heap(order_.begin(), order_.end(), before);
          order_.back() = id;
          std::push_heap(order_.begin(), order_.end(), before);
        }
      }
      std::sort_heap(order_.begin(), order_.end(), before);
      return;
    }
    order_.resize(size_t(V));
    std::iota(order_.begin(), order_.end(), 0);
    if (n < V) std::nth_element(order_.begin(), order_.begin() + n, order_.end(), before);
    std::sort(order_.begin(), order_.begin() + n, before);
  };
  // The nucleus of a sorted prefix: the shortest one whose share of `total` reaches top_p (all of it when none).
  auto nucleus = [&](int n, double total) {
    double cumulative = 0;
    for (int i = 0; i < n; ++i) {
      cumulative += weight_[size_t(i)] / total;
      if (cumulative >= params_.top_p) return i + 1;
    }
    return n;
  };
  int keep = V;
  if (params_.top_k > 0 && params_.top_k < V) {
    const int k = params_.top_k;
    sort_prefix(k);
    weight_.resize(size_t(k));
    double total = 0;
    for (int i = 0; i < k; ++i) total += (weight_[size_t(i)] = weight(order_[size_t(i)]));
    keep = nucleus(k, total);
  } else if (params_.top_p < 1.0f) {
    double total = 0;
    for (int id = 0; id < V; ++id) total += weight(id);
    for (int n = std::min(V, 64);; n = std::min(V, 4 * n)) {
      sort_prefix(n);
      weight_.resize(size_t(n));
      double covered = 0;
      for (int i = 0; i < n; ++i) covered += (weight_[size_t(i)] = weight(order_[size_t(i)]));
      keep = nucleus(n, total);
      if (keep < n || covered / total >= params_.top_p || n == V) break;
    }
  } else {  // the whole distribution, in id order: the weights and their total, then the drawn id
    weight_.resize(size_t(V));
    double total = 0;
    for (int id = 0; id < V; ++id) total += (weight_[size_t(id)] = weight(id));
    const double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
    double cumulative = 0;
    int last = 0;  // the last id with a nonzero weight: where rounding could leave u past the final sum
    for (int id = 0; id < V; ++id) {
      if (weight_[size_t(id)] == 0) continue;
      last = id;
      if ((cumulative += weight_[size_t(id)]) > u) return id;
    }
    return last;
  }
  std::discrete_distribution<int> pick(weight_.begin(), weight_.begin() + keep);
  return int32_t(order_[size_t(pick(rng_))]);
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
