// SPDX-License-Identifier: MIT
// Speculative decoding on the CUDA runner: rollback of a verify step (CudaRunner::rollback: the compressor rows
// saved before it, rebuilt from the kept rows by gpu::compressor_state), Session's verify loop on the GPU, and the
// MTP block on the GPU (its logits against the CPU block's, its drafts in Session).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "core/check.h"
#include "cuda/device.h"
#include "cuda/runner.h"
#include "cuda_test_util.h"
#include "model_test_util.h"
#include "model/model.h"
#include "model/session.h"
#include "model/speculate.h"

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

Model golden_model(const std::string& name, Numerics numerics) {
  return Model::load((fs::path(DSV4_TEST_DATA) / "golden" / name).string(), numerics);
}

const Numerics kF32{cpu::KvStorage::F32, cpu::IndexerStorage::F32};

int argmax_of(const float* v, int n) { return int(std::max_element(v, v + n) - v); }

// Runners A and B feed the same real tokens, each step followed by junk drafts (different junk in A and B) that
// are rolled back; C feeds the real tokens alone. The steps cross every compressor block boundary of the tiny
// models many times (ratios 4 .. 16), with 0 to 16 junk tokens. Forgotten tokens must leave no trace: A and B
// bit-identical (a kept row never sees a later row, so only a trace of the junk could tell them apart); and the
// state they keep must be the right one: A within fp32 rounding of C (a verify step's rows go through kernels of
// another row count than C's; same bounds as the other reorderings in test_cuda_model.cpp).
void check_rollback(const std::string& name, Numerics numerics, bool compare_plain) {
  const Model model = golden_model(name, numerics);
  const int V = model.config().vocab_size;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(2, V - 1);
  std::vector<int32_t> prompt(40);
  for (int32_t& t : prompt) t = token(rng);
  const std::vector<std::pair<int, int>> steps{{1, 4}, {2, 3}, {1, 1}, {3, 5}, {1, 16}, {5, 2}, {1, 0}, {7, 6},
                                               {1, 3}, {2, 14}, {4, 4}, {1, 2}, {6, 11}, {1, 1}, {3, 7}, {2, 2}};
  int total = int(prompt.size());
  for (int round = 0; round < 4; ++round)
    for (auto [f, j] : steps) total += f + j;
  CudaRunnerOptions options;
  options.prefill_chunk = 64;
  auto a = make_cuda_runner(model, total, options), b = make_cuda_runner(model, total, options),
       c = make_cuda_runner(model, total, options);
  std::vector<float> la = a->forward(prompt, true), lb = b->forward(prompt, true), lc = c->forward(prompt, true);
  ASSERT_EQ(a->max_rollback(), kMaxRollback);
  int64_t rolled = 0;
  for (int round = 0; round < 4; ++round)
    for (auto [f, j] : steps) {
      std::vector<int32_t> real(static_cast<size_t>(f));
      std::vector<int32_t> fa, fb;
      for (int32_t& t : real) t = token(rng);
      fa = fb = real;
      for (int i = 0; i < j; ++i) fa.push_back(token(rng)), fb.push_back(token(rng));
      const int64_t keep = a->n_tokens() + f;
      const std::vector<float> ra = a->forward(fa, false), rb = b->forward(fb, false);
      a->rollback(keep);
      b->rollback(keep);
      ASSERT_EQ(a->n_tokens(), keep);
      rolled += j;
      la.insert(la.end(), ra.begin(), ra.begin() + ptrdiff_t(f) * V);
      lb.insert(lb.end(), rb.begin(), rb.begin() + ptrdiff_t(f) * V);
      const std::vector<float> rc = c->forward(real, false);
      lc.insert(lc.end(), rc.begin(), rc.end());
    }
  // One more plain step on each: reads the state the last rollback left.
  const std::vector<int32_t> last{token(rng)};
  for (auto [r, l] : {std::pair{a.get(), &la}, std::pair{b.get(), &lb}, std::pair{c.get(), &lc}}) {
    const std::vector<float> row = r->forward(last, true);
    l->insert(l->end(), row.begin(), row.end());
  }
  ASSERT_EQ(la.size(), lb.size());
  ASSERT_EQ(la.size(), lc.size());
  const bool same = std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)) == 0;
  cuda_test::Diff plain;
  plain.add(la, lc, V);
  const double scale = plain.max_ref;
  std::printf("[cuda-rollback] %s: %lld junk tokens rolled back over %zu rows; A vs B %s; A vs plain per-row max "
              "|diff| median %.3g, max %.3g of max|logit| %.3g\n", name.c_str(), (long long)rolled,
              plain.row_max.size(), same ? "bit-identical" : "DIFFER", plain.quantile(0.5), plain.max_abs, scale);
  EXPECT_TRUE(same) << name;
  if (compare_plain) {
    EXPECT_LE(plain.quantile(0.5), 1e-4 * scale) << name;
    EXPECT_LE(plain.max_abs, 5e-3 * scale) << name;
  }
  // Only the last forward can be rolled back, and only when it fed 2 .. kMaxRollback + 1 tokens.
  EXPECT_THROW(a->rollback(a->n_tokens() - 1), Error);  // after a one-token forward
  const int64_t before = a->n_tokens();
  a->forward(std::vector<int32_t>(3, 5), false);
  EXPECT_THROW(a->rollback(before - 1), Error);  // before that forward
  a->rollback(before);
  EXPECT_EQ(a->n_tokens(), before);
}

TEST(CudaRollback, ForgottenDraftsLeaveNoTrace) {
  DSV4_REQUIRE_CUDA();
  check_rollback("tiny-flash", kF32, true);
  check_rollback("tiny-pro", kF32, true);
  check_rollback("tiny-flash", Numerics{}, false);  // FP8 KV / FP4 indexer keys: the exact check only
}

// Greedy generation of max_new_tokens past any EOS, keeping the logits (plain decoding's, for near-tie checks).
GenerateOptions greedy_with_logits(int max_new_tokens) {
  GenerateOptions o;
  o.max_new_tokens = max_new_tokens;
  o.stop_at_eos = false;
  o.keep_logits = true;
  return o;
}

// A speculative run against plain decoding of the same prompt (greedy, plain with its logits): each kept draft
// saves a forward, and the tokens are plain decoding's unless the two first differ at a near-tie of plain's logits
// (a verify step's rows and a graph step's row round differently).
void expect_plain_tokens(const char* what, const GenerateResult& plain, const GenerateResult& spec, size_t prompt_len,
                         int V) {
  size_t first_diff = 0;
  while (first_diff < plain.output_ids.size() && first_diff < spec.output_ids.size() &&
         plain.output_ids[first_diff] == spec.output_ids[first_diff])
    ++first_diff;
  std::printf("%s: %d of %d drafts kept, %d forwards for %zu tokens (plain %d); outputs agree on %zu of %zu tokens\n",
              what, spec.accepted, spec.drafted, spec.decode_steps, spec.output_ids.size(), plain.decode_steps,
              first_diff, plain.output_ids.size());
  EXPECT_EQ(spec.decode_steps + spec.accepted, plain.decode_steps) << what;
  if (first_diff < plain.output_ids.size()) {  // only at a near-tie of the plain run's logits
    const double margin = cuda_test::top2_margin(plain.logits.data() + (prompt_len - 1 + first_diff) * size_t(V), V);
    std::printf("%s: first difference at token %zu, plain top-2 margin %.3g\n", what, first_diff, margin);
    EXPECT_LT(margin, 1e-2) << what << ": speculation changed a token that was not a near-tie";
  } else {
    EXPECT_EQ(spec.output_ids, plain.output_ids) << what;
  }
}

// Session's verify loop on the GPU: n-gram drafts on a prompt that repeats itself, greedy. The tokens are plain
// decoding's unless the two differ first at a near-tie (a verify step's rows and a graph step's row round
// differently); drafts are kept, and each kept draft saves a forward.
TEST(CudaRollback, SpeculationGivesPlainDecodingsTokens) {
  DSV4_REQUIRE_CUDA();
  const Model model = golden_model("tiny-flash", kF32);
  const int V = model.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int r = 0; r < 6; ++r)
    for (int32_t t : {5, 17, 99, 42, 7, 200, 12}) prompt.push_back(t);  // vocab 256
  GenerateOptions o = greedy_with_logits(80);
  auto plain_runner = make_cuda_runner(model, 256), spec_runner = make_cuda_runner(model, 256);
  const GenerateResult plain = Session(*plain_runner).generate(prompt, o);
  o.speculate.method = DraftMethod::Ngram;
  o.speculate.max_draft = 6;
  const GenerateResult spec = Session(*spec_runner).generate(prompt, o);
  // The verify rows drawn on the device (CudaRunner::forward_draw_rows): the same logits and the same draw
  // contract, so the same tokens as the host draws of them.
  CudaRunnerOptions on_device;
  on_device.draw_on_device = true;
  auto device_runner = make_cuda_runner(model, 256, on_device);
  o.keep_logits = false;  // logits would take the host path
  const GenerateResult drawn = Session(*device_runner).generate(prompt, o);
  EXPECT_EQ(drawn.output_ids, spec.output_ids);
  EXPECT_EQ(drawn.accepted, spec.accepted);
  expect_plain_tokens("[cuda-speculate] n-gram", plain, spec, prompt.size(), V);
  EXPECT_GT(spec.drafted, 0);
  EXPECT_GT(spec.accepted, 0);
}

// The golden tiny-mtp checkpoint with its MTP block (random weights: its guesses are rarely kept).
Model tiny_mtp(Numerics numerics) {
  return Model::load((fs::path(DSV4_TEST_DATA) / "golden" / "tiny-mtp").string(), numerics, WeightLoad::DecodeAll,
                     true);
}

// The MTP block on the GPU against the CPU block on the weights the GPU holds (linears rounded to bf16): 150 ids
// fed to the main model in pieces of 1 to 40 tokens, each followed by the MTP block on every pair it trails by, so
// its logits cover the pairs of positions 0..148 once (the CPU: one forward, one mtp_forward over all 149 pairs).
// The block reads the main model's final streams, so it carries their differences too: >= 90 % of rows within 5e-2
// of max|logit| (the FP8 models' bound in test_cuda_model.cpp; on the H100 91 % were within 3e-2 and 90 % within
// 2.6e-2, so another GPU's split-k choices keep a margin), the greedy guesses equal where the CPU's top-2 margin
// exceeds twice the row's difference; and mtp_draft (drawn on the device) is the argmax of the same logits.
TEST(CudaMtp, MatchesTheCpuBlock) {
  DSV4_REQUIRE_CUDA();
  const Model model = tiny_mtp(kF32);
  ASSERT_TRUE(model.has_mtp());
  const Model reference(model.config(), bf16_linears(model.weights()), kF32);
  ASSERT_TRUE(reference.has_mtp());
  const int V = model.config().vocab_size, n = 150;
  std::vector<int32_t> ids(n);
  for (int i = 0; i < n; ++i) ids[size_t(i)] = int32_t((i * 37 + 11) % V);
  std::vector<float> streams;
  SequenceState state = reference.new_sequence(200);
  reference.forward(state, ids, true, &streams);
  const std::vector<float> want =
      reference.mtp_forward(state, streams.data(), std::span<const int32_t>(ids.data() + 1, n - 1), false);

  auto gpu = make_cuda_runner(model, 200), drafter = make_cuda_runner(model, 200);
  ASSERT_TRUE(gpu->has_mtp());
  std::vector<float> got;
  int guesses = 0, guesses_equal = 0;
  const std::vector<int> pieces{1, 7, 2, 30, 40, 1, 13, 5, 26, 25};
  for (size_t k = 0, at = 0; at < size_t(n); ++k) {
    const size_t len = std::min<size_t>(pieces[k % pieces.size()], n - at);
    const std::span<const int32_t> piece(ids.data() + at, len);
    gpu->forward(piece, true);
    drafter->forward(piece, true);
    at += len;
    const int64_t pending = gpu->mtp_pending(), first = gpu->n_tokens() - pending;
    ASSERT_EQ(drafter->mtp_pending(), pending);
    ASSERT_LE(pending, int64_t(len) + 1) << "the block trails by the unpaired rows only";
    const int64_t pairs = at < size_t(n) ? pending : pending - 1;  // the last position has no next token
    if (pairs == 0) continue;
    const std::span<const int32_t> next(ids.data() + first + 1, size_t(pairs));
    const std::vector<float> rows = cuda_runner_mtp_logits(*gpu, next);
    ASSERT_EQ(rows.size(), size_t(pairs) * V);
    got.insert(got.end(), rows.begin(), rows.end());
    const int32_t guess = drafter->mtp_draft(next);
    ++guesses;
    guesses_equal += guess == argmax_of(rows.data() + size_t(pairs - 1) * V, V);
    EXPECT_EQ(gpu->mtp_pending(), pending - pairs);
  }
  ASSERT_EQ(got.size(), want.size());
  cuda_test::Diff diff;
  diff.add(got, want, V);
  int checked = 0, agree = 0;
  for (int r = 0; r < n - 1; ++r) {
    const float* w = want.data() + size_t(r) * V;
    if (cuda_test::top2_margin(w, V) > 2 * diff.row_max[size_t(r)]) {
      ++checked;
      agree += argmax_of(got.data() + size_t(r) * V, V) == argmax_of(w, V);
    }
  }
  std::printf("[cuda-mtp] %d pairs: max|gpu - cpu| %.3g of max|logit| %.3g (per-row median %.3g, p90 %.3g), rows "
              "within 3e-2: %.0f%%, within 5e-2: %.0f%%; greedy %d/%d margin-checked rows agree; mtp_draft = argmax "
              "of the logits in %d/%d calls\n", n - 1, diff.max_abs, diff.max_ref, diff.quantile(0.5),
              diff.quantile(0.9), 100 * diff.fraction_within(3e-2 * diff.max_ref),
              100 * diff.fraction_within(5e-2 * diff.max_ref), agree, checked, guesses_equal, guesses);
  EXPECT_GT(diff.max_ref, 1.0);
  EXPECT_GE(diff.fraction_within(5e-2 * diff.max_ref), 0.9);
  EXPECT_EQ(agree, checked);
  EXPECT_EQ(guesses_equal, guesses);
}

// Session with MTP drafts on the GPU: the tokens of plain decoding (up to a near-tie), one draft a step, and a
// runner whose sequence was rolled back and reset drafts like a fresh one.
TEST(CudaMtp, SpeculationGivesPlainDecodingsTokens) {
  DSV4_REQUIRE_CUDA();
  const Model model = tiny_mtp(kF32);
  const int V = model.config().vocab_size;
  std::vector<int32_t> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back(int32_t((i * 53 + 7) % V));
  GenerateOptions o = greedy_with_logits(40);
  auto plain_runner = make_cuda_runner(model, 128), spec_runner = make_cuda_runner(model, 128);
  const GenerateResult plain = Session(*plain_runner).generate(prompt, o);
  o.speculate.method = DraftMethod::Mtp;
  o.speculate.max_draft = 1;
  const GenerateResult spec = Session(*spec_runner).generate(prompt, o);
  spec_runner->reset();
  const GenerateResult again = Session(*spec_runner).generate(prompt, o);
  EXPECT_EQ(again.output_ids, spec.output_ids);
  EXPECT_EQ(again.accepted, spec.accepted);
  expect_plain_tokens("[cuda-mtp] Session, MTP", plain, spec, prompt.size(), V);
  EXPECT_GE(spec.drafted, int(spec.output_ids.size()) - 2);  // a guess every step but the last
}

}  // namespace
}  // namespace dsv4
