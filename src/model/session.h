// SPDX-License-Identifier: MIT
// Text-free generation on one sequence: prefill a prompt, then decode token by token from the preallocated
// state. A Session keeps its state between calls, so a chat appends each turn to the same sequence.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "model/model.h"
#include "model/runner.h"
#include "model/sampler.h"
#include "model/speculate.h"

namespace dsv4 {

struct GenerateOptions {
  int max_new_tokens = 16;
  bool stop_at_eos = true;
  bool keep_logits = false;  // collect the next-token logits of every consumed position
  SamplingParams sampling;
  SpeculateOptions speculate;  // drafts verified in one forward (same tokens as without; model/speculate.h)
  std::function<void(int32_t)> on_token;  // called as each token is chosen (streaming)
};

struct GenerateResult {
  std::vector<int32_t> output_ids;
  std::vector<float> logits;  // [rows, vocab] when keep_logits: row i = logits after the i-th consumed token
  int logit_rows = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  int decode_steps = 0;         // decode forwards
  int drafted = 0, accepted = 0;  // speculative decoding: drafts verified, drafts kept
};

class Session {
 public:
  explicit Session(SequenceRunner& runner) : runner_(runner) {}

  // Appends `prompt` to the sequence and generates up to max_new_tokens tokens. The last generated token is not
  // fed back, so the next call must pass it at the start of its prompt if the conversation continues.
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options);

  void reset() {
    runner_.reset();
    history_.clear();
  }
  const SequenceRunner& runner() const { return runner_; }

 private:
  SequenceRunner& runner_;
  std::vector<int32_t> history_;  // the tokens this session fed (n-gram drafts look them up)
};

}  // namespace dsv4
