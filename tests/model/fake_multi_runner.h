// SPDX-License-Identifier: MIT
// Test double: several CPU sequences behind one SequenceRunner that steps sequences 0..B-1 together and copies
// states, the primitives the CUDA runner gives BatchRunner (cuda_runner_select_sequence / decode_batch /
// copy_sequence), so the packed batch runner and the scheduler on it are tested without a GPU.
#pragma once
#include <memory>
#include <span>
#include <vector>

#include "model/batch_runner.h"
#include "model/model.h"
#include "model/sampler.h"

namespace dsv4::testing {

// Several CPU sequences behind one SequenceRunner, like a CUDA runner with CudaRunnerOptions::sequences.
class FakeMultiRunner final : public SequenceRunner {
 public:
  FakeMultiRunner(const Model& model, int held, int max_context) : model_(model) {
    for (int i = 0; i < held; ++i) states_.push_back(model.new_sequence(max_context));
  }
  const ModelConfig& config() const override { return model_.config(); }
  std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) override {
    return model_.forward(states_[size_t(current_)], tokens, last_only);
  }
  int64_t n_tokens() const override { return states_[size_t(current_)].n_tokens; }
  int max_context() const override { return states_[0].max_context; }
  void reset() override { states_[size_t(current_)].reset(); }
  size_t state_bytes() const override { return 0; }

  void select(int seq) { current_ = seq; }
  std::vector<float> decode_first(std::span<const int32_t> tokens) {
    std::vector<float> logits;
    for (size_t b = 0; b < tokens.size(); ++b) {
      const std::vector<float> row = model_.forward(states_[b], tokens.subspan(b, 1), true);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    ++steps;
    return logits;
  }
  // decode_first with each row's token drawn by draws[b] (on the host here; the CUDA runner draws on the device).
  std::vector<int32_t> decode_first_draw(std::span<const int32_t> tokens, std::span<const TokenDraw> draws) {
    const std::vector<float> logits = decode_first(tokens);
    const size_t vocab = logits.size() / tokens.size();
    std::vector<int32_t> ids;
    for (size_t b = 0; b < tokens.size(); ++b)
      ids.push_back(draw_token(std::span<const float>(logits).subspan(b * vocab, vocab), draws[b]));
    ++drawn_steps;
    return ids;
  }
  void copy(int from, int to) {
    states_[size_t(to)] = states_[size_t(from)];
    ++copies;
  }
  int steps = 0, copies = 0, drawn_steps = 0;

 private:
  const Model& model_;
  std::vector<SequenceState> states_;
  int current_ = 0;
};

// A packed BatchRunner of `slots` slots on a FakeMultiRunner (returned in *fake for its counters); `backend_draws`:
// the backend draws a step's tokens itself (PackedSequences::decode_first_draw), like the CUDA runner on the device.
inline std::unique_ptr<BatchRunner> packed_cpu_batch_runner(const Model& model, int slots, int max_context,
                                                            FakeMultiRunner** fake, bool backend_draws = false) {
  auto runner = std::make_unique<FakeMultiRunner>(model, slots + 1, max_context);
  *fake = runner.get();
  PackedSequences b;
  b.runner = std::move(runner);
  b.held = slots + 1;
  b.select = [](SequenceRunner& r, int s) { static_cast<FakeMultiRunner&>(r).select(s); };
  b.decode_first = [](SequenceRunner& r, std::span<const int32_t> t) {
    return static_cast<FakeMultiRunner&>(r).decode_first(t);
  };
  b.copy = [](SequenceRunner& r, int from, int to) { static_cast<FakeMultiRunner&>(r).copy(from, to); };
  if (backend_draws)
    b.decode_first_draw = [](SequenceRunner& r, std::span<const int32_t> t, std::span<const TokenDraw> d) {
      return static_cast<FakeMultiRunner&>(r).decode_first_draw(t, d);
    };
  return make_packed_batch_runner(std::move(b), slots);
}

}  // namespace dsv4::testing
