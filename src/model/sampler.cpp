// SPDX-License-Identifier: MIT
#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"
#include "core/parallel.h"
#include "formats/float_key.h"

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

TokenDraw Sampler::next_draw(int vocab) {
  TokenDraw d = without_u(vocab);
  if (params_.temperature <= 0.0f) return d;
  if (!given_back_.empty()) {
    d.u = given_back_.front();
    given_back_.pop_front();
  } else {
    d.u = double(rng_() >> 11) * 0x1.0p-53;  // 53 random bits: [0, 1)
  }
  return d;
}

void Sampler::give_back(std::span<const TokenDraw> unused) {
  if (params_.temperature <= 0.0f) return;
  for (auto d = unused.rbegin(); d != unused.rend(); ++d) given_back_.push_front(d->u);
}

TokenDraw Sampler::without_u(int vocab) const {
  TokenDraw d;
  d.temperature = params_.temperature;
  d.top_p = params_.top_p;
  d.top_k = params_.top_k;
  d.vocab = vocab;
  return d;
}

// The nucleus without sorting the vocabulary: a radix select of its last key (formats/float_key.h), 4 passes of 8
// bits, each over the ids still in the running (their weights summed per digit, from the highest digit down, until
// the running weight reaches `target`), the way the GPU's draw_tokens finds it. Leaves the nucleus in order_[0, keep):
// every id with a key above the last one, then the fewest ids of the last key, lowest first, that reach the target;
// returns keep.
int Sampler::nucleus_by_selection(std::span<const float> logits, uint64_t target) {
  const int V = int(logits.size());
  keys_.resize(size_t(V));
  order_.resize(size_t(V));
  for (int id = 0; id < V; ++id) {
    keys_[size_t(id)] = float_order_key(logits[size_t(id)]);
    order_[size_t(id)] = id;
  }
  uint64_t above = 0;  // the weight of the ids whose keys are above every candidate's
  int n = V;           // candidates order_[0, n), ascending ids, all sharing the digits chosen so far
  for (int shift = 24; shift >= 0; shift -= 8) {
    uint64_t mass[256] = {};
    for (int i = 0; i < n; ++i) {
      const int id = order_[size_t(i)];
      mass[(keys_[size_t(id)] >> shift) & 0xffu] += weight_[size_t(id)];
    }
    uint32_t digit = 255;
    for (; digit > 0 && above + mass[digit] < target; --digit) above += mass[digit];
    int kept = 0;
    for (int i = 0; i < n; ++i) {
      const int id = order_[size_t(i)];
      if (((keys_[size_t(id)] >> shift) & 0xffu) == digit) order_[size_t(kept++)] = id;
    }
    n = kept;
  }
  // order_[0, n): the ids of the last key, ascending, each of the same weight.
  const uint32_t last_key = keys_[size_t(order_[0])];
  const uint64_t w = weight_[size_t(order_[0])];
  const int ties = int(std::min<uint64_t>(uint64_t(n), w > 0 ? (target - above + w - 1) / w : 1));
  ties_.assign(order_.begin(), order_.begin() + ties);
  int keep = 0;
  for (int id = 0; id < V; ++id)
    if (keys_[size_t(id)] > last_key) order_[size_t(keep++)] = id;
  for (int id : ties_) order_[size_t(keep++)] = id;
  return keep;
}

// Every id's weight into weight_ (a branch-free float loop the compiler vectorises, then the integer conversion);
// returns their total.
uint64_t Sampler::weigh_all(std::span<const float> logits, float mx, float inv_t) {
  const size_t V = logits.size();
  value_.resize(V);
  weight_.resize(V);
  for (size_t id = 0; id < V; ++id)
    value_[id] = draw_weight_value(draw_detail::mul(draw_detail::sub(logits[id], mx), inv_t));
  uint64_t total = 0;
  for (size_t id = 0; id < V; ++id) total += (weight_[id] = uint64_t(int64_t(value_[id])));
  return total;
}

// The cut without sorting the vocabulary (a full sort of 129K ids took ~20 ms per token on one core, more than a
// GPU decode step):
//   top_k < V: the k best ids (a one-pass heap up to 1024, else nth_element + sort) and only their weights, then
//     the nucleus among them;
//   no top_k, top_p < 1: every weight, the 64 best ids by heap, and when they do not reach the target the nucleus
//     by selection;
//   no top_k, top_p = 1: every weight, no cut.
int Sampler::cut(std::span<const float> logits, const TokenDraw& d, float mx, uint64_t& total) {
  const int V = int(logits.size());
  const float inv_t = 1.0f / d.temperature;
  const auto before = before_in(logits);
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
  // The length of the shortest prefix of order_[0, n) whose weight reaches target; -1 if none does.
  auto reach = [&](int n, uint64_t target) {
    uint64_t acc = 0;
    for (int i = 0; i < n; ++i)
      if ((acc += weight_[size_t(order_[size_t(i)])]) >= target) return i + 1;
    return -1;
  };
  const bool nucleus = d.top_p < 1.0f;
  if (d.top_k > 0 && d.top_k < V) {
    const int k = d.top_k;
    sort_prefix(k);
    weight_.resize(size_t(V));  // only the k ids of the cut are weighed
    uint64_t sum = 0;
    for (int i = 0; i < k; ++i) {
      const int id = order_[size_t(i)];
      sum += (weight_[size_t(id)] = draw_weight(logits[size_t(id)], mx, inv_t));
    }
    const int keep = nucleus ? reach(k, nucleus_target(d.top_p, sum)) : k;
    return keep > 0 ? keep : k;
  }
  total = weigh_all(logits, mx, inv_t);
  if (!nucleus) return -1;
  const uint64_t target = nucleus_target(d.top_p, total);
  const int n = std::min(V, 64);  // most nuclei of a language model are short: the 64 best ids by heap first
  sort_prefix(n);
  const int keep = reach(n, target);
  return keep > 0 ? keep : nucleus_by_selection(logits, target);
}

int32_t Sampler::draw(std::span<const float> row, const TokenDraw& d) {
  DSV4_CHECK(d.vocab >= 0 && size_t(d.vocab) <= row.size(), "draw: vocab {} outside a row of {} logits", d.vocab,
             row.size());
  const std::span<const float> logits = d.vocab > 0 ? row.first(size_t(d.vocab)) : row;
  DSV4_CHECK(!logits.empty(), "draw: empty logits");
  if (d.temperature == 0.0f) return argmax(logits);
  const float mx = *std::max_element(logits.begin(), logits.end());
  if (!std::isfinite(mx)) return argmax(logits);
  uint64_t total = 0;
  const int keep = cut(logits, d, mx, total);
  if (keep < 0) {  // the whole row, walked in id order
    const uint64_t r = draw_point(d.u, total);
    uint64_t acc = 0;
    for (size_t id = 0; id < logits.size(); ++id)
      if ((acc += weight_[id]) > r) return int32_t(id);
    return argmax(logits);  // not reached: r < total
  }
  // The cut, walked in id order: sorted when short, else marked over the row.
  const auto cut_ids = std::span<int>(order_).first(size_t(keep));
  total = 0;
  for (int id : cut_ids) total += weight_[size_t(id)];
  const uint64_t r = draw_point(d.u, total);
  uint64_t acc = 0;
  if (keep <= 4096) {
    std::sort(cut_ids.begin(), cut_ids.end());
    for (int id : cut_ids)
      if ((acc += weight_[size_t(id)]) > r) return id;
  } else {
    in_cut_.assign(logits.size(), 0);
    for (int id : cut_ids) in_cut_[size_t(id)] = 1;
    for (size_t id = 0; id < logits.size(); ++id)
      if (in_cut_[id] && (acc += weight_[id]) > r) return int32_t(id);
  }
  return argmax(logits);  // not reached: r < total
}

std::vector<int32_t> Sampler::kept_ids(std::span<const float> logits) {
  DSV4_CHECK(!logits.empty(), "kept_ids: empty logits");
  if (params_.temperature == 0.0f) return {argmax(logits)};
  uint64_t total = 0;
  const int keep = cut(logits, without_u(int(logits.size())), *std::max_element(logits.begin(), logits.end()), total);
  std::vector<int32_t> ids;
  if (keep < 0) {
    ids.resize(logits.size());
    std::iota(ids.begin(), ids.end(), 0);
  } else {
    ids.assign(order_.begin(), order_.begin() + keep);
    std::sort(ids.begin(), ids.end());
  }
  return ids;
}

int32_t draw_token(std::span<const float> logits, const TokenDraw& d) {
  thread_local Sampler scratch{SamplingParams{}};
  return scratch.draw(logits, d);
}

std::vector<int32_t> draw_rows(std::span<const float> logits, std::span<const TokenDraw> draws) {
  DSV4_CHECK(!draws.empty() && logits.size() % draws.size() == 0, "draw_rows: {} logits for {} rows", logits.size(),
             draws.size());
  const size_t vocab = logits.size() / draws.size();
  std::vector<int32_t> ids(draws.size());
  // Threads pay from about 2^16 logits (a row of the real 129K vocabulary takes 0.05-2 ms).
  const bool worth_threads = logits.size() >= (size_t(1) << 16);
  const std::vector<std::string> failed = parallel_indices(
      int(draws.size()),
      [&](int i) { ids[size_t(i)] = draw_token(logits.subspan(size_t(i) * vocab, vocab), draws[size_t(i)]); },
      worth_threads);
  for (const std::string& f : failed) DSV4_CHECK(f.empty(), "draw_rows: {}", f);
  return ids;
}

}  // namespace dsv4
