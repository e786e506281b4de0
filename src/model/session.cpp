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

namespace {
// "Before": the order a cut takes ids in, higher logit first, lower id among equal logits.
auto before_in(std::span<const float> logits) {
  return [logits](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
}
// Greedy: the highest logit, the lowest id among equal ones.
int32_t argmax(std::span<const float> logits) {
  return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}
}  // namespace

// The nucleus without sorting the vocabulary: quickselect over all ids in "before" order, each round keeping the
// side where the cumulative weight crosses top_p · total (linear time), then a sort of the last few. Leaves
// order_[0, keep) = the nucleus (sorted when it has at most 4096 ids), weight_[i] = the weight of order_[i]
// (weight_of[id]: every id's weight); returns keep.
int Sampler::nucleus_by_selection(std::span<const float> logits, std::span<const double> weight_of, double total) {
  const int V = int(logits.size());
  const auto before = before_in(logits);
  auto weight = [&](int id) { return weight_of[size_t(id)]; };
  order_.resize(size_t(V));
  std::iota(order_.begin(), order_.end(), 0);
  const double target = params_.top_p * total;
  double acc = 0;  // the weight of order_[0, lo): ids all in the nucleus
  int lo = 0, hi = V, keep = -1;
  while (keep < 0 && hi - lo > 32) {
    const int a = order_[size_t(lo)], b = order_[size_t(lo + (hi - lo) / 2)], c = order_[size_t(hi - 1)];
    const int pivot = before(a, b) ? (before(b, c) ? b : before(a, c) ? c : a)
                                   : (before(a, c) ? a : before(b, c) ? c : b);  // the median of the three
    // [lo, m): before the pivot; then the pivot at m; then (m, hi): after it.
    auto before_pivot = [&](int id) { return before(id, pivot); };
    const int m = int(std::partition(order_.begin() + lo, order_.begin() + hi, before_pivot) - order_.begin());
    std::iter_swap(order_.begin() + m, std::find(order_.begin() + m, order_.begin() + hi, pivot));
    double left = 0;
    for (int i = lo; i < m; ++i) left += weight(order_[size_t(i)]);
    if (acc + left >= target) {
      hi = m;
    } else if ((acc += left) + weight(pivot) >= target) {
      keep = m + 1;
    } else {
      acc += weight(pivot);
      lo = m + 1;
    }
  }
  if (keep < 0) {
    std::sort(order_.begin() + lo, order_.begin() + hi, before);
    keep = hi;
    for (int i = lo; i < hi; ++i)
      if ((acc += weight(order_[size_t(i)])) >= target) {
        keep = i + 1;
        break;
      }
  }
  // Nuclei of up to 4096 ids are drawn from in "before" order, like the top-k case (the order does not change the
  // distribution; it keeps a seed's draws the same as a full sort would give).
  if (keep <= 4096) std::sort(order_.begin(), order_.begin() + keep, before);
  weight_.resize(size_t(keep));
  for (int i = 0; i < keep; ++i) weight_[size_t(i)] = weight(order_[size_t(i)]);
  return keep;
}

// Exact sampling without sorting the vocabulary (a full sort of 129K ids took ~20 ms per token on one core, more
// than a GPU decode step). Ids are cut in "before" order (before_in).
//   top_k < V: the k best ids (a one-pass heap up to 1024, else nth_element + sort), then the nucleus among them
//     (the order and sums of the full sort);
//   no top_k, top_p < 1: the total over all ids, the 64 best ids by heap, and when they do not reach top_p the
//     nucleus by selection (nucleus_by_selection);
//   no top_k, top_p = 1: every id, weighed in id order (no order is needed to draw from the whole distribution).
// Weights are computed in float (exp of (logit - max) / temperature) and summed in double.
int Sampler::cut(std::span<const float> logits) {
  const int V = int(logits.size());
  const auto before = before_in(logits);
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
    weight_of_.resize(size_t(V));
    double total = 0;
    for (int id = 0; id < V; ++id) total += (weight_of_[size_t(id)] = weight(id));
    const int n = std::min(V, 64);  // most nuclei of a language model are short: the 64 best ids by heap first
    sort_prefix(n);
    weight_.resize(size_t(n));
    double covered = 0;
    for (int i = 0; i < n; ++i) covered += (weight_[size_t(i)] = weight_of_[size_t(order_[size_t(i)])]);
    keep = nucleus(n, total);
    if (keep == n && covered / total < params_.top_p && n < V) keep = nucleus_by_selection(logits, weight_of_, total);
  } else {  // the whole distribution: the weights by id
    weight_.resize(size_t(V));
    for (int id = 0; id < V; ++id) weight_[size_t(id)] = weight(id);
    keep = -1;
  }
  return keep;
}

int32_t Sampler::sample(std::span<const float> logits) {
  DSV4_CHECK(!logits.empty(), "sample: empty logits");
  if (params_.temperature == 0.0f) return argmax(logits);
  const int keep = cut(logits);
  if (keep >= 0) {
    std::discrete_distribution<int> pick(weight_.begin(), weight_.begin() + keep);
    return int32_t(order_[size_t(pick(rng_))]);
  }
  // The whole distribution, drawn in id order (no order is needed to draw from all of it).
  const double total = std::accumulate(weight_.begin(), weight_.end(), 0.0);
  const double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
  double cumulative = 0;
  int last = 0;  // the last id with a nonzero weight: where rounding could leave u past the final sum
  for (int id = 0; id < int(weight_.size()); ++id) {
    if (weight_[size_t(id)] == 0) continue;
    last = id;
    if ((cumulative += weight_[size_t(id)]) > u) return id;
  }
  return last;
}

std::vector<int32_t> Sampler::kept_ids(std::span<const float> logits) {
  DSV4_CHECK(!logits.empty(), "kept_ids: empty logits");
  if (params_.temperature == 0.0f) return {argmax(logits)};
  const int keep = cut(logits);
  if (keep >= 0) return std::vector<int32_t>(order_.begin(), order_.begin() + keep);
  std::vector<int32_t> all(logits.size());
  std::iota(all.begin(), all.end(), 0);
  return all;
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
