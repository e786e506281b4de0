// SPDX-License-Identifier: MIT
// Choosing the next token: greedy, or a draw at a temperature with top-k and top-p (nucleus) cuts, by the draw
// contract of formats/token_draw.h. The Sampler owns a request's random generator; the draw itself is a function
// of the logits and one uniform u, so a backend can run it on the device (SequenceRunner::forward_draw) and give
// the same id the host would.
#pragma once
#include <cstdint>
#include <deque>
#include <random>
#include <span>
#include <vector>

#include "formats/token_draw.h"

namespace dsv4 {

struct SamplingParams {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id among equal logits)
  float top_p = 1.0f;        // nucleus: smallest set of tokens whose probability reaches top_p
  int top_k = 0;             // 0 = no limit
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // The next token of a row of logits (every id of the row can be drawn).
  int32_t sample(std::span<const float> logits) { return draw(logits, next_draw(int(logits.size()))); }
  // The next draw among ids [0, vocab): the parameters and a fresh uniform (none for greedy), consuming the
  // randomness one sample() would.
  TokenDraw next_draw(int vocab);
  // Draws taken by next_draw but not used (speculative decoding draws a row per draft and uses those up to the
  // first rejection): their uniforms come back, in order, from the following next_draw calls, so a seed gives
  // the same tokens with and without speculation.
  void give_back(std::span<const TokenDraw> unused);
  // The token the contract gives for `logits` (a row of at least d.vocab values) and `d`.
  int32_t draw(std::span<const float> logits, const TokenDraw& d);
  // The ids a draw from these logits can come from, in id order: the cut (every id without one), the argmax when
  // greedy. Consumes no randomness.
  std::vector<int32_t> kept_ids(std::span<const float> logits);

 private:
  // The cut (formats/token_draw.h) of logits whose maximum is mx: returns keep with order_[0, keep) = the cut's ids
  // (in no set order) and weight_[id] their weights, or -1 without a cut, with weight_ = every id's weight and
  // total = their sum.
  int cut(std::span<const float> logits, const TokenDraw& d, float mx, uint64_t& total);
  int nucleus_by_selection(std::span<const float> logits, uint64_t target);
  uint64_t weigh_all(std::span<const float> logits, float mx, float inv_t);
  TokenDraw without_u(int vocab) const;

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::deque<double> given_back_;  // uniforms of unused draws, next_draw's before the generator's
  std::vector<int> order_;         // scratch: ids, a sorted prefix first
  std::vector<uint64_t> weight_;   // scratch: ids' weights
  std::vector<float> value_;       // scratch: the same as floats (the vectorised loop)
  std::vector<uint8_t> in_cut_;    // scratch: a long cut as a mask over the row
  std::vector<uint32_t> keys_;     // scratch: every id's order key (the nucleus's radix select)
  std::vector<int> ties_;          // scratch: the nucleus's ids of its last key
};

// The token of `d` from `logits` on the host (Sampler::draw with this thread's scratch).
int32_t draw_token(std::span<const float> logits, const TokenDraw& d);
// The tokens of rows of logits [draws.size(), vocab], row i by draws[i], drawn on the host in parallel (a draw over
// a 129K vocabulary takes 0.2-2 ms, docs/perf.md). Throws the first row's failure.
std::vector<int32_t> draw_rows(std::span<const float> logits, std::span<const TokenDraw> draws);

}  // namespace dsv4
