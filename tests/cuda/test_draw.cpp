// SPDX-License-Identifier: MIT
// gpu::draw_tokens against the host Sampler (both implement formats/token_draw.h, whose weights are integers): the
// same id for every row, exactly, over vocabularies from 1 id to the Flash 129280, ties across the cuts, -inf and
// -0 logits, vocabulary limits, u at 0 and just below 1, many rows with their own parameters in one launch. Then the
// CUDA runner drawing on the device (CudaRunnerOptions::draw_on_device, inside the decode graph) against the same
// runner's logits drawn on the host.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <random>

#include "core/check.h"
#include "cuda/ops.h"
#include "cuda/runner.h"
#include "cuda_test_util.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/session.h"

namespace fs = std::filesystem;
using namespace dsv4;
using namespace dsv4::cuda_test;

namespace {

struct Case {
  int vocab;      // the row length (ld)
  float spread;   // logits ~ N(0, spread)
  bool tied;      // rounded to multiples of 1/2: runs of equal logits across the cuts
};

// rows of logits, each with its own draw, through one launch; ids compared with draw_token.
void check_rows(const Case& c, const std::vector<TokenDraw>& draws, std::mt19937& rng) {
  const int rows = int(draws.size()), V = c.vocab;
  std::normal_distribution<float> normal(0.0f, c.spread);
  std::vector<float> logits(size_t(rows) * V);
  for (float& l : logits) l = c.tied ? std::round(normal(rng) * 2.0f) / 2.0f : normal(rng);
  if (V > 8) {  // a few special values in every row
    for (int r = 0; r < rows; ++r) {
      logits[size_t(r) * V + 1] = -std::numeric_limits<float>::infinity();
      logits[size_t(r) * V + 2] = -0.0f;
      logits[size_t(r) * V + 3] = 0.0f;
    }
  }
  DeviceBuffer d_logits = to_device(logits), d_draws = to_device(draws);
  DeviceBuffer d_ids(size_t(rows) * sizeof(int32_t));
  d_ids.fill_bytes(0xff);  // -1: a row the kernel does not write fails
  gpu::DrawTokensParams p;
  p.logits = d_logits.as<float>();
  p.ld = V;
  p.vocab = V;
  p.rows = rows;
  p.draws = d_draws.as<TokenDraw>();
  p.ids = d_ids.as<int32_t>();
  gpu::draw_tokens(p, nullptr);
  cuda_test::sync();
  const std::vector<int32_t> got = to_host<int32_t>(d_ids, size_t(rows));
  for (int r = 0; r < rows; ++r) {
    const TokenDraw& d = draws[size_t(r)];
    const int32_t want = draw_token(std::span<const float>(logits).subspan(size_t(r) * V, size_t(V)), d);
    ASSERT_EQ(got[size_t(r)], want) << "V " << V << " spread " << c.spread << " tied " << c.tied << " row " << r
                                    << ": T " << d.temperature << " top_p " << d.top_p << " top_k " << d.top_k
                                    << " vocab " << d.vocab << " u " << d.u;
  }
}

TEST(CudaDraw, SameIdAsTheHostContract) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(99);
  int rows_checked = 0;
  for (const Case& c : {Case{1, 1.0f, false}, Case{7, 1.0f, true}, Case{1000, 0.2f, false}, Case{1000, 3.0f, true},
                        Case{5000, 0.0f, false}, Case{50000, 2.0f, false}, Case{129280, 3.0f, false},
                        Case{129280, 1.0f, true}}) {
    std::vector<TokenDraw> draws;
    for (float t : {0.0f, 0.6f, 1.0f, 1.7f})
      for (float top_p : {1.0f, 0.95f, 0.5f, 0.1f})
        for (int top_k : {0, 1, 40, 2000}) {
          TokenDraw d{t, top_p, top_k, 0, 0.0};
          const uint32_t pick = rng() % 5;
          d.u = pick == 0 ? 0.0 : pick == 1 ? std::nextafter(1.0, 0.0) : double(rng() >> 5) * 0x1.0p-27;
          if (c.vocab > 3 && rng() % 3 == 0) d.vocab = c.vocab - 1 - int(rng() % uint32_t(c.vocab / 3));
          draws.push_back(d);
        }
    for (size_t first = 0; first < draws.size(); first += 64) {  // up to 64 rows per launch, like a decode batch
      const std::vector<TokenDraw> batch(draws.begin() + first, draws.begin() + std::min(draws.size(), first + 64));
      check_rows(c, batch, rng);
      rows_checked += int(batch.size());
    }
  }
  EXPECT_EQ(rows_checked, 8 * 64);
}

TEST(CudaDraw, RejectsBadShapes) {
  DSV4_REQUIRE_CUDA();
  gpu::DrawTokensParams p;
  p.rows = 1;
  p.vocab = 0;
  EXPECT_THROW(gpu::draw_tokens(p, nullptr), Error);
  p.vocab = 10;
  p.ld = 5;
  EXPECT_THROW(gpu::draw_tokens(p, nullptr), Error);
}

Model models_tiny() { return Model::load((fs::path(DSV4_TEST_DATA) / ".." / ".." / "models" / "tiny").string()); }

// Session::generate on a runner that draws on the device and on one that returns logits to the host Sampler: the
// same logits (same kernels) and the same contract give the same tokens; the drawing runner replays its graph.
TEST(CudaDraw, RunnerDrawsOnTheDeviceLikeTheHost) {
  DSV4_REQUIRE_CUDA();
  const Model model = models_tiny();
  CudaRunnerOptions on;
  on.draw_on_device = true;
  std::unique_ptr<SequenceRunner> drawing = make_cuda_runner(model, 128, on);
  std::unique_ptr<SequenceRunner> plain = make_cuda_runner(model, 128);
  ASSERT_TRUE(cuda_runner_draws_on_device(*drawing));
  const std::vector<int32_t> prompt{5, 17, 99, 42, 7, 300};
  for (const SamplingParams& sp : {SamplingParams{}, SamplingParams{0.9f, 1.0f, 0, 3}, SamplingParams{1.1f, 0.9f, 0, 4},
                                   SamplingParams{0.8f, 0.95f, 20, 5}}) {
    drawing->reset();
    plain->reset();
    GenerateOptions options;
    options.max_new_tokens = 24;
    options.stop_at_eos = false;
    options.sampling = sp;
    const GenerateResult a = Session(*drawing).generate(prompt, options);
    options.keep_logits = true;  // the host path: logits back, Sampler::sample
    const GenerateResult b = Session(*plain).generate(prompt, options);
    EXPECT_EQ(a.output_ids, b.output_ids) << "T " << sp.temperature << " top_p " << sp.top_p << " top_k " << sp.top_k;
    const CudaRunnerStats stats = cuda_runner_stats(*drawing);
    EXPECT_TRUE(stats.last_forward_replayed_graph);
  }
}

// cuda_runner_decode_batch_draw against cuda_runner_decode_batch + draw_token on a twin runner fed the same tokens.
TEST(CudaDraw, BatchedStepDrawsEachRow) {
  DSV4_REQUIRE_CUDA();
  const Model model = models_tiny();
  constexpr int B = 6;
  CudaRunnerOptions on, off;
  on.draw_on_device = true;
  on.sequences = off.sequences = B;
  std::unique_ptr<SequenceRunner> drawing = make_cuda_runner(model, 96, on);
  std::unique_ptr<SequenceRunner> plain = make_cuda_runner(model, 96, off);
  const int V = model.config().vocab_size;
  std::mt19937 rng(5);
  for (int b = 0; b < B; ++b) {
    std::vector<int32_t> prompt(3 + b);
    for (int32_t& t : prompt) t = int32_t(rng() % V);
    for (auto* r : {drawing.get(), plain.get()}) {
      cuda_runner_select_sequence(*r, b);
      r->forward(prompt, true);
    }
  }
  std::vector<int32_t> tokens(B, 11);
  for (int step = 0; step < 10; ++step) {
    std::vector<TokenDraw> draws;
    for (int b = 0; b < B; ++b)
      draws.push_back({b == 0 ? 0.0f : 1.0f, b % 2 ? 0.9f : 1.0f, b == 3 ? 10 : 0, b == 4 ? V - 2 : 0,
                       double(rng() >> 11) * 0x1.0p-53});
    const std::vector<int32_t> got = cuda_runner_decode_batch_draw(*drawing, tokens, draws);
    const std::vector<float> logits = cuda_runner_decode_batch(*plain, tokens);
    ASSERT_EQ(got.size(), size_t(B));
    for (int b = 0; b < B; ++b)
      ASSERT_EQ(got[size_t(b)], draw_token(std::span<const float>(logits).subspan(size_t(b) * V, size_t(V)),
                                           draws[size_t(b)]))
          << "step " << step << " row " << b;
    tokens = got;
  }
  EXPECT_TRUE(cuda_runner_stats(*drawing).last_forward_replayed_graph);
  EXPECT_THROW(cuda_runner_decode_batch_draw(*drawing, tokens, std::vector<TokenDraw>(B - 1)), Error);
}

}  // namespace
