// SPDX-License-Identifier: MIT
// Session::generate draws through SequenceRunner::forward_draw when it keeps no logits, and through the host
// Sampler on the returned logits when it does: both paths must give the same tokens for a seed (the generator
// advances the same way), greedy or sampled, and the runner path must not bring logits back.
#include <gtest/gtest.h>

#include <filesystem>

#include "model/model.h"
#include "model/session.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

const Model& tiny_model() {
  static const Model model = Model::load((fs::path(DSV4_SOURCE_DIR) / "models" / "tiny").string());
  return model;
}

// A CPU runner that counts how it is asked for tokens.
class CountingRunner final : public SequenceRunner {
 public:
  explicit CountingRunner(int max_context) : inner_(make_cpu_runner(tiny_model(), max_context)) {}
  const ModelConfig& config() const override { return inner_->config(); }
  std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) override {
    ++forwards;
    return inner_->forward(tokens, last_only);
  }
  int32_t forward_draw(std::span<const int32_t> tokens, const TokenDraw& draw) override {
    ++draws;
    return SequenceRunner::forward_draw(tokens, draw);  // which calls forward()
  }
  int64_t n_tokens() const override { return inner_->n_tokens(); }
  int max_context() const override { return inner_->max_context(); }
  void reset() override { inner_->reset(); }
  size_t state_bytes() const override { return inner_->state_bytes(); }
  int forwards = 0, draws = 0;

 private:
  std::unique_ptr<SequenceRunner> inner_;
};

TEST(Session, RunnerDrawsGiveTheSameTokensAsHostSampling) {
  const std::vector<int32_t> prompt{5, 17, 99, 42};
  for (const SamplingParams& p : {SamplingParams{}, SamplingParams{0.9f, 1.0f, 0, 3}, SamplingParams{1.2f, 0.85f, 0, 4},
                                  SamplingParams{0.7f, 0.95f, 12, 5}}) {
    CountingRunner drawing(64), keeping(64);
    GenerateOptions options;
    options.max_new_tokens = 12;
    options.stop_at_eos = false;
    options.sampling = p;
    const GenerateResult a = Session(drawing).generate(prompt, options);
    options.keep_logits = true;
    const GenerateResult b = Session(keeping).generate(prompt, options);
    EXPECT_EQ(a.output_ids, b.output_ids) << "T " << p.temperature << " top_p " << p.top_p << " top_k " << p.top_k;
    ASSERT_EQ(a.output_ids.size(), 12u);
    EXPECT_EQ(drawing.draws, 12);  // the prefill and 11 decode steps each drew in the runner
    EXPECT_EQ(keeping.draws, 0);
    EXPECT_TRUE(a.logits.empty());
    EXPECT_EQ(b.logit_rows, 4 + 11);
  }
}

TEST(Session, NoNewTokensDrawsNothing) {
  CountingRunner runner(64);
  GenerateOptions options;
  options.max_new_tokens = 0;
  const GenerateResult r = Session(runner).generate(std::vector<int32_t>{1, 2, 3}, options);
  EXPECT_TRUE(r.output_ids.empty());
  EXPECT_EQ(runner.draws, 0);
  EXPECT_EQ(runner.n_tokens(), 3);
}

}  // namespace
