// SPDX-License-Identifier: MIT
// Text-free generation on one sequence: prefill a prompt, then decode token by token from the preallocated
// state. A Session keeps its state between calls, so a chat appends each turn to the same sequence.
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "model/model.h"
#include "model/runner.h"

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
  int32_t sample(std::span<const float> logits);
  // The ids a draw from these logits can return: the top-k / nucleus cut, every id without one, the argmax when
  // greedy. Consumes no randomness.
  std::vector<int32_t> kept_ids(std::span<const float> logits);

 private:
  // The cut of a draw: leaves order_[0, keep) = the kept ids and weight_[i] = the weight of order_[i], returns keep;
  // without a cut returns -1 with weight_[id] = every id's weight.
  int cut(std::span<const float> logits);
  int nucleus_by_selection(std::span<const float> logits, std::span<const double> weight_of, double total);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int> order_;       // scratch: ids, a sorted prefix first
  std::vector<double> weight_;   // scratch: the weights of the ids drawn from
  std::vector<double> weight_of_;  // scratch: every id's weight (nucleus without top-k)
};

struct GenerateOptions {
  int max_new_tokens = 16;
  bool stop_at_eos = true;
  bool keep_logits = false;  // collect the next-token logits of every consumed position
  SamplingParams sampling;
  std::function<void(int32_t)> on_token;  // called as each token is chosen (streaming)
};

struct GenerateResult {
  std::vector<int32_t> output_ids;
  std::vector<float> logits;  // [rows, vocab] when keep_logits: row i = logits after the i-th consumed token
  int logit_rows = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int decode_steps = 0;
};

class Session {
 public:
  explicit Session(SequenceRunner& runner) : runner_(runner) {}

  // Appends `prompt` to the sequence and generates up to max_new_tokens tokens. The last generated token is not
  // fed back, so the next call must pass it at the start of its prompt if the conversation continues.
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options);

  void reset() { runner_.reset(); }
  const SequenceRunner& runner() const { return runner_; }

 private:
  SequenceRunner& runner_;
};

}  // namespace dsv4
