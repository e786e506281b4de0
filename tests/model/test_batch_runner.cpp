// SPDX-License-Identifier: MIT
// BatchRunner: the packed runner (all sequences in one backend that steps sequences 0..B-1 together, the way the CUDA
// runner batches a decode step) against one runner per sequence, on the embedded tiny model. A fake backend on the
// CPU holds the states and copies them like cuda_runner_copy_sequence; a seeded schedule of resets, prompt chunks
// and decodes of shuffled sequence subsets (and ended requests, whose states the packed runner may overwrite) must
// give the same logits bit for bit, however often the packed runner moves states to bring a step's sequences onto
// 0..B-1.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <numeric>
#include <random>

#include "core/check.h"
#include "fake_multi_runner.h"
#include "model/batch_runner.h"
#include "model/model.h"
#include "model/sampler.h"

namespace fs = std::filesystem;
using namespace dsv4;
using dsv4::testing::FakeMultiRunner;
using dsv4::testing::packed_cpu_batch_runner;

namespace {

const Model& tiny_model() {
  static const Model model = Model::load((fs::path(DSV4_SOURCE_DIR) / "models" / "tiny").string());
  return model;
}

TEST(BatchRunner, PackedMatchesOneRunnerPerSequence) {
  constexpr int kSlots = 5, kContext = 96;
  FakeMultiRunner* fake = nullptr;
  std::unique_ptr<BatchRunner> a = packed_cpu_batch_runner(tiny_model(), kSlots, kContext, &fake);
  std::unique_ptr<BatchRunner> b = make_looped_batch_runner(
      [](int max_context) { return make_cpu_runner(tiny_model(), max_context); }, kSlots, kContext);
  ASSERT_EQ(a->sequences(), kSlots);
  std::mt19937 rng(2026);
  const int V = tiny_model().config().vocab_size;
  std::uniform_int_distribution<int> token(0, V - 1);
  int decodes = 0;
  std::vector<bool> released(kSlots, false);  // a released slot's state may be overwritten until its next reset
  for (int step = 0; step < 80; ++step) {
    const int what = int(rng() % 8);
    if (what == 7) {  // a request ends
      const int s = int(rng() % kSlots);
      a->release(s);
      b->release(s);
      released[size_t(s)] = true;
    } else if (what == 0) {  // a slot starts over with a prompt chunk
      const int s = int(rng() % kSlots);
      a->reset(s);
      b->reset(s);
      released[size_t(s)] = false;
      std::vector<int32_t> prompt(1 + rng() % 7);
      for (int32_t& t : prompt) t = token(rng);
      ASSERT_EQ(a->forward(s, prompt, true), b->forward(s, prompt, true)) << "step " << step;
    } else {  // a shuffled subset of the slots with room decodes one token each
      std::vector<int> seqs;
      for (int s = 0; s < kSlots; ++s)
        if (!released[size_t(s)] && a->n_tokens(s) > 0 && a->n_tokens(s) < kContext && rng() % 3 != 0)
          seqs.push_back(s);
      if (seqs.empty()) continue;
      std::shuffle(seqs.begin(), seqs.end(), rng);
      std::vector<int32_t> tokens(seqs.size());
      for (int32_t& t : tokens) t = token(rng);
      ASSERT_EQ(a->decode(seqs, tokens), b->decode(seqs, tokens)) << "step " << step;
      ++decodes;
    }
    for (int s = 0; s < kSlots; ++s)
      if (!released[size_t(s)]) ASSERT_EQ(a->n_tokens(s), b->n_tokens(s)) << "slot " << s;
  }
  EXPECT_GT(decodes, 30);
  EXPECT_EQ(fake->steps, decodes);  // one backend step per decode, whatever the subset
  EXPECT_GT(fake->copies, 0);       // the schedule did move states
}

// decode_draw on every kind of batch runner (packed with a backend that draws, packed drawing on the host, one runner
// per sequence drawing through SequenceRunner::forward_draw) gives the ids that draw_token gives from decode()'s
// logits, each row with its own draw parameters and uniform, over shuffled subsets of slots.
TEST(BatchRunner, DecodeDrawEqualsDrawingFromTheLogits) {
  constexpr int kSlots = 4, kContext = 64;
  FakeMultiRunner *drawing = nullptr, *plain = nullptr;
  std::vector<std::unique_ptr<BatchRunner>> runners;
  runners.push_back(packed_cpu_batch_runner(tiny_model(), kSlots, kContext, &drawing, true));
  runners.push_back(packed_cpu_batch_runner(tiny_model(), kSlots, kContext, &plain, false));
  auto cpu = [](int max_context) { return make_cpu_runner(tiny_model(), max_context); };
  runners.push_back(make_looped_batch_runner(cpu, kSlots, kContext));
  std::unique_ptr<BatchRunner> reference = make_looped_batch_runner(cpu, kSlots, kContext);
  std::mt19937 rng(77);
  const int V = tiny_model().config().vocab_size;
  for (int s = 0; s < kSlots; ++s) {
    const std::vector<int32_t> prompt{int32_t(rng() % V), int32_t(rng() % V)};
    for (auto& r : runners) r->forward(s, prompt, true);
    reference->forward(s, prompt, true);
  }
  int sampled = 0;
  for (int step = 0; step < 24; ++step) {
    std::vector<int> seqs;
    for (int s = 0; s < kSlots; ++s)
      if (rng() % 4 != 0) seqs.push_back(s);
    if (seqs.empty()) continue;
    std::shuffle(seqs.begin(), seqs.end(), rng);
    std::vector<int32_t> tokens;
    std::vector<TokenDraw> draws;
    for (size_t i = 0; i < seqs.size(); ++i) {
      tokens.push_back(int32_t(rng() % V));
      const float temperature = std::array{0.0f, 0.7f, 1.0f, 1.5f}[rng() % 4];
      draws.push_back({temperature, rng() % 2 ? 1.0f : 0.8f, int32_t(rng() % 3 == 0 ? 5 : 0),
                       int32_t(rng() % 2 ? 0 : V - 3), double(rng() % 1000) / 1000.0});
      sampled += temperature > 0;
    }
    const std::vector<float> logits = reference->decode(seqs, tokens);
    std::vector<int32_t> want;
    for (size_t i = 0; i < seqs.size(); ++i)
      want.push_back(draw_token(std::span<const float>(logits).subspan(i * size_t(V), size_t(V)), draws[i]));
    for (size_t k = 0; k < runners.size(); ++k)
      ASSERT_EQ(runners[k]->decode_draw(seqs, tokens, draws), want) << "runner " << k << " step " << step;
  }
  EXPECT_GT(sampled, 20);
  EXPECT_GT(drawing->drawn_steps, 15);  // the drawing backend drew its steps itself
  EXPECT_EQ(plain->drawn_steps, 0);
}

TEST(BatchRunner, SteadyDecodingMovesNothing) {
  FakeMultiRunner* fake = nullptr;
  std::unique_ptr<BatchRunner> a = packed_cpu_batch_runner(tiny_model(), 4, 64, &fake);
  for (int s : {1, 3}) a->forward(s, std::vector<int32_t>{5, 17}, true);
  const std::vector<int> seqs = {3, 1};
  a->decode(seqs, std::vector<int32_t>{1, 2});
  const int after_first = fake->copies;
  for (int i = 0; i < 5; ++i) a->decode(seqs, std::vector<int32_t>{1, 2});
  EXPECT_EQ(fake->copies, after_first);
}

TEST(BatchRunner, MovesOnlySlotsOutsideTheStepsPlaces) {
  FakeMultiRunner* fake = nullptr;
  std::unique_ptr<BatchRunner> a = packed_cpu_batch_runner(tiny_model(), 4, 64, &fake);
  for (int s = 0; s < 4; ++s) a->forward(s, std::vector<int32_t>{5, 17}, true);
  a->decode(std::vector<int>{0, 1, 2}, std::vector<int32_t>{1, 2, 3});
  EXPECT_EQ(fake->copies, 0);  // already on 0..2
  a->decode(std::vector<int>{2, 1, 0}, std::vector<int32_t>{1, 2, 3});
  EXPECT_EQ(fake->copies, 0);  // another order, same places
  a->decode(std::vector<int>{0, 2}, std::vector<int32_t>{1, 2});
  EXPECT_EQ(fake->copies, 3);  // slot 2 onto the place slot 1 left: one swap
  a->decode(std::vector<int>{3}, std::vector<int32_t>{4});
  EXPECT_EQ(fake->copies, 6);  // slot 3 onto place 0
}

TEST(BatchRunner, AReleasedSlotIsOverwrittenNotKept) {
  FakeMultiRunner* fake = nullptr;
  std::unique_ptr<BatchRunner> a = packed_cpu_batch_runner(tiny_model(), 3, 64, &fake);
  for (int s = 0; s < 3; ++s) a->forward(s, std::vector<int32_t>{5, 17}, true);
  a->release(0);  // its request ended
  a->decode(std::vector<int>{2}, std::vector<int32_t>{1});
  EXPECT_EQ(fake->copies, 1);  // slot 2 onto place 0: one copy, nothing of slot 0 kept
  EXPECT_EQ(a->n_tokens(2), 3);
  a->reset(0);  // a new request takes slot 0 (now on place 2)
  a->forward(0, std::vector<int32_t>{7}, true);
  a->decode(std::vector<int>{0, 2}, std::vector<int32_t>{1, 2});  // slot 0 onto place 1, held by live slot 1
  EXPECT_EQ(fake->copies, 4);
  EXPECT_EQ(a->n_tokens(0), 2);
  EXPECT_EQ(a->n_tokens(1), 2);  // slot 1 was kept
  EXPECT_EQ(a->n_tokens(2), 4);
}

TEST(BatchRunner, RejectsBadSequenceSets) {
  FakeMultiRunner* fake = nullptr;
  std::unique_ptr<BatchRunner> a = packed_cpu_batch_runner(tiny_model(), 3, 32, &fake);
  EXPECT_THROW(a->decode(std::vector<int>{0, 0}, std::vector<int32_t>{1, 2}), Error);
  EXPECT_THROW(a->decode(std::vector<int>{3}, std::vector<int32_t>{1}), Error);
  EXPECT_THROW(a->decode(std::vector<int>{0}, std::vector<int32_t>{1, 2}), Error);
  PackedSequences too_few;
  too_few.runner = std::make_unique<FakeMultiRunner>(tiny_model(), 3, 32);
  too_few.held = 3;
  too_few.select = [](SequenceRunner&, int) {};
  too_few.decode_first = [](SequenceRunner&, std::span<const int32_t>) { return std::vector<float>{}; };
  too_few.copy = [](SequenceRunner&, int, int) {};
  EXPECT_THROW(make_packed_batch_runner(std::move(too_few), 3), Error);  // no spare sequence
}

}  // namespace
