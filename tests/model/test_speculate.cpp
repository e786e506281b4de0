// SPDX-License-Identifier: MIT
// Speculative decoding (model/speculate.h): n-gram drafts, the sampler's given-back draws, and Session::generate
// with drafts verified and rolled back on the CPU runner, which must emit exactly the tokens plain decoding emits
// (greedy and sampled, runner draws and host draws, one turn and a continued conversation) while taking fewer
// forwards when drafts are kept.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "core/check.h"
#include "io/npy.h"
#include "model/model.h"
#include "model/session.h"
#include "model/speculate.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

// fp32 KV and indexer keys: under the default fp8 / fp4 rounding a chunk and token-by-token decode already differ
// by up to 0.17 in a logit on this model (a 1e-7 difference moves a value across a rounding boundary), which would
// hide what the kept logits are compared for here.
const Model& tiny_model() {
  static const Model model = Model::load((fs::path(DSV4_SOURCE_DIR) / "models" / "tiny").string(),
                                         {cpu::KvStorage::F32, cpu::IndexerStorage::F32});
  return model;
}

std::vector<int32_t> draft(std::vector<int32_t> context, int max_tokens, int lo = 1, int hi = 3) {
  return ngram_draft(context, max_tokens, lo, hi);
}

TEST(NgramDraft, ContinuesTheLatestOccurrenceOfTheLongestSuffix) {
  // The 3-gram 1 2 3 occurred at 0 and 4: the latest (4) is followed by 9 1 2 3.
  EXPECT_EQ(draft({1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3}, 3), (std::vector<int32_t>{9, 1, 2}));
  EXPECT_EQ(draft({1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3}, 8), (std::vector<int32_t>{9, 1, 2, 3}));  // up to the end
  // No earlier 6 7 6 or 7 6: the 1-gram 6 (at 1) is followed by 7 6.
  EXPECT_EQ(draft({5, 6, 7, 6}, 4), (std::vector<int32_t>{7, 6}));
  EXPECT_EQ(draft({5, 6, 7, 6}, 4, 2, 3), std::vector<int32_t>{});  // 1-grams not allowed
  // A run: the suffix 7 7 overlaps its earlier occurrence at 0.
  EXPECT_EQ(draft({7, 7, 7}, 4, 2, 2), (std::vector<int32_t>{7}));
  EXPECT_EQ(draft({1, 2, 3, 4}, 4), std::vector<int32_t>{});  // nothing recurs
  EXPECT_EQ(draft({4}, 4), std::vector<int32_t>{});
  EXPECT_EQ(draft({1, 2, 1}, 0), std::vector<int32_t>{});
}

TEST(Sampler, GivenBackDrawsComeAgainInOrder) {
  const SamplingParams p{0.8f, 1.0f, 0, 17};
  Sampler a(p), b(p);
  std::vector<TokenDraw> da, db;
  for (int i = 0; i < 4; ++i) da.push_back(a.next_draw(100));
  for (int i = 0; i < 6; ++i) db.push_back(b.next_draw(100));
  a.give_back(std::span<const TokenDraw>(da).subspan(2));  // the 3rd and 4th were not used
  for (int i = 2; i < 6; ++i) EXPECT_EQ(a.next_draw(100).u, db[i].u) << i;
  EXPECT_NE(db[2].u, db[3].u);
}

// A CPU runner that counts forwards and can hide its rollback (a backend without one).
class CountingRunner final : public SequenceRunner {
 public:
  CountingRunner(int max_context, bool can_roll_back)
      : inner_(make_cpu_runner(tiny_model(), max_context)), can_roll_back_(can_roll_back) {}
  const ModelConfig& config() const override { return inner_->config(); }
  std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) override {
    ++forwards;
    fed += int(tokens.size());
    return inner_->forward(tokens, last_only);
  }
  int64_t n_tokens() const override { return inner_->n_tokens(); }
  int max_context() const override { return inner_->max_context(); }
  int max_rollback() const override { return can_roll_back_ ? inner_->max_rollback() : 0; }
  void rollback(int64_t n) override {
    rolled_back += int(n_tokens() - n);
    inner_->rollback(n);
  }
  void reset() override { inner_->reset(); }
  size_t state_bytes() const override { return inner_->state_bytes(); }
  int forwards = 0, fed = 0, rolled_back = 0;

 private:
  std::unique_ptr<SequenceRunner> inner_;
  bool can_roll_back_;
};

GenerateOptions options_for(const SamplingParams& sampling, DraftMethod method, bool keep_logits) {
  GenerateOptions o;
  o.max_new_tokens = 150;  // past the first HCA block (128) from a 10-token prompt
  o.stop_at_eos = false;
  o.keep_logits = keep_logits;
  o.sampling = sampling;
  o.speculate.method = method;
  o.speculate.max_draft = 5;
  return o;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  return worst;
}

TEST(Speculate, SameTokensAsPlainDecodingInFewerForwards) {
  const std::vector<int32_t> prompt{5, 17, 99, 42, 5, 17, 99, 42, 5, 17};
  int accepted_greedy = 0;
  for (const SamplingParams& p : {SamplingParams{}, SamplingParams{0.9f, 1.0f, 0, 3}, SamplingParams{0.7f, 0.9f, 20, 5}}) {
    for (bool keep_logits : {false, true}) {
      CountingRunner plain_runner(256, true), spec_runner(256, true);
      const GenerateResult plain =
          Session(plain_runner).generate(prompt, options_for(p, DraftMethod::None, keep_logits));
      const GenerateResult spec =
          Session(spec_runner).generate(prompt, options_for(p, DraftMethod::Ngram, keep_logits));
      const std::string what = "T " + std::to_string(p.temperature) + (keep_logits ? " host draws" : " runner draws");
      ASSERT_EQ(plain.output_ids.size(), 150u) << what;
      EXPECT_EQ(spec.output_ids, plain.output_ids) << what;
      EXPECT_EQ(spec_runner.n_tokens(), plain_runner.n_tokens()) << what;  // the last token stays unfed in both
      EXPECT_EQ(spec_runner.fed - spec_runner.rolled_back, plain_runner.fed) << what;
      EXPECT_EQ(spec.drafted, spec.accepted + spec_runner.rolled_back) << what;
      EXPECT_EQ(spec.decode_steps + spec.accepted, plain.decode_steps) << what;  // each kept draft saves a forward
      EXPECT_EQ(plain.drafted, 0);
      if (keep_logits) {
        EXPECT_EQ(spec.logit_rows, plain.logit_rows) << what;
        EXPECT_LE(max_diff(spec.logits, plain.logits), 1e-4) << what;
      }
      std::printf("[speculate] %s: %d steps for %zu tokens (plain %d), %d of %d drafts kept\n", what.c_str(),
                  spec.decode_steps, spec.output_ids.size(), plain.decode_steps, spec.accepted, spec.drafted);
      if (p.temperature == 0) accepted_greedy = spec.accepted;
    }
  }
  // The random tiny model repeats itself a little under greedy decoding (10 of 151 n-gram drafts kept when
  // measured): some must be kept, or drafting or the acceptance is broken.
  EXPECT_GE(accepted_greedy, 5);
}

TEST(Speculate, ContinuedConversationMatchesPlainDecoding) {
  const std::vector<int32_t> turn1{5, 17, 99, 42}, turn2_tail{7, 8, 9};
  std::vector<std::vector<int32_t>> outputs[2];
  for (int spec = 0; spec < 2; ++spec) {
    CountingRunner runner(256, true);
    Session session(runner);
    GenerateOptions o = options_for({}, spec ? DraftMethod::Ngram : DraftMethod::None, false);
    o.max_new_tokens = 40;
    const GenerateResult a = session.generate(turn1, o);
    std::vector<int32_t> turn2{a.output_ids.back()};  // the last token was not fed (Session's contract)
    turn2.insert(turn2.end(), turn2_tail.begin(), turn2_tail.end());
    const GenerateResult b = session.generate(turn2, o);
    outputs[spec] = {a.output_ids, b.output_ids};
  }
  EXPECT_EQ(outputs[1], outputs[0]);
}

TEST(Speculate, BackendWithoutRollbackDecodesPlainly) {
  const std::vector<int32_t> prompt{5, 17, 99, 42, 5, 17, 99, 42};
  CountingRunner plain_runner(256, true), no_rollback(256, false);
  const GenerateResult plain = Session(plain_runner).generate(prompt, options_for({}, DraftMethod::None, false));
  const GenerateResult r = Session(no_rollback).generate(prompt, options_for({}, DraftMethod::Ngram, false));
  EXPECT_EQ(r.output_ids, plain.output_ids);
  EXPECT_EQ(r.drafted, 0);
  EXPECT_EQ(no_rollback.rolled_back, 0);
}

TEST(Speculate, DraftsStopAtTheContextAndTheTokenBudget) {
  const std::vector<int32_t> prompt{5, 17, 99, 42, 5, 17, 99, 42};
  for (int max_new : {1, 2, 7}) {
    CountingRunner runner(32, true), plain_runner(32, true);
    GenerateOptions o = options_for({}, DraftMethod::Ngram, false);
    o.max_new_tokens = max_new;
    const GenerateResult r = Session(runner).generate(prompt, o);
    o.speculate.method = DraftMethod::None;
    const GenerateResult plain = Session(plain_runner).generate(prompt, o);
    EXPECT_EQ(r.output_ids, plain.output_ids);
    EXPECT_EQ(runner.n_tokens(), int64_t(prompt.size()) + max_new - 1);
  }
  // A context of 20: generation stops when it is full, drafts never overflow it.
  CountingRunner runner(20, true), plain_runner(20, true);
  const GenerateResult r = Session(runner).generate(prompt, options_for({}, DraftMethod::Ngram, false));
  const GenerateResult plain = Session(plain_runner).generate(prompt, options_for({}, DraftMethod::None, false));
  EXPECT_EQ(r.output_ids, plain.output_ids);
  EXPECT_EQ(runner.n_tokens(), 20);
  EXPECT_EQ(r.output_ids.size(), 13u);
}

TEST(Speculate, UnknownMethodIsAnError) {
  EXPECT_EQ(parse_draft_method("ngram"), DraftMethod::Ngram);
  EXPECT_EQ(parse_draft_method("none"), DraftMethod::None);
  EXPECT_EQ(parse_draft_method("mtp"), DraftMethod::Mtp);
  EXPECT_THROW(parse_draft_method("mtp2"), Error);
}

// models/tiny plus an MTP block made of its own layers and random e_proj / h_proj (reference/make_tiny_mtp.py).
std::string tiny_with_mtp_dir() { return (fs::path(DSV4_TEST_DATA) / "golden" / "tiny-mtp").string(); }

const Model& tiny_mtp_model() {
  static const Model model =
      Model::load(tiny_with_mtp_dir(), {cpu::KvStorage::F32, cpu::IndexerStorage::F32}, WeightLoad::DecodeAll, true);
  return model;
}

TEST(Mtp, LoadsOnRequestAndRefusesCheckpointsWithout) {
  EXPECT_TRUE(tiny_mtp_model().has_mtp());
  EXPECT_FALSE(Model::load(tiny_with_mtp_dir()).has_mtp());  // not asked for
  EXPECT_THROW(Model::load((fs::path(DSV4_SOURCE_DIR) / "models" / "tiny").string(), {}, WeightLoad::DecodeAll, true),
               Error);
}

// The MTP block against reference/dsv4_ref.py's (reference/mtp_golden.py, fp64 with fp32 KV and indexer keys; the
// transformers port has no MTP block): every pair (X_i, ids[i+1]) of a 150-token sequence, past the block's
// 128-token window. fp32 against fp64: the reference's own fp32 run is 1.7e-5 from its fp64 one and the engine 1.8e-5
// (measured), so 1e-4 leaves room for summation order and nothing for a wrong formula.
TEST(Mtp, MatchesTheReferenceImplementation) {
  const Model& model = tiny_mtp_model();
  const int V = model.config().vocab_size;
  const NpyArray ids_npy = read_npy((fs::path(tiny_with_mtp_dir()) / "mtp_ids.npy").string());
  const NpyArray want = read_npy((fs::path(tiny_with_mtp_dir()) / "mtp_logits_f64.npy").string());
  const NpyArray want_f32 = read_npy((fs::path(tiny_with_mtp_dir()) / "mtp_logits.npy").string());
  std::vector<int32_t> ids(ids_npy.values.begin(), ids_npy.values.end());
  ASSERT_EQ(ids.size(), 150u);
  ASSERT_EQ(want.shape, (std::vector<int64_t>{149, V}));
  std::vector<float> streams;
  SequenceState state = model.new_sequence(200);
  model.forward(state, ids, true, &streams);
  const std::vector<float> got =
      model.mtp_forward(state, streams.data(), std::span<const int32_t>(ids.data() + 1, ids.size() - 1), false);
  ASSERT_EQ(got.size(), want.values.size());
  double worst = 0, reference_noise = 0, largest = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::fabs(got[i] - want.values[i]));
    reference_noise = std::max(reference_noise, std::fabs(want_f32.values[i] - want.values[i]));
    largest = std::max(largest, std::fabs(want.values[i]));
  }
  std::printf("[mtp-golden] 149 rows: max |engine - fp64 reference| %.3g (reference fp32 vs fp64 %.3g, max|logit| "
              "%.3g)\n", worst, reference_noise, largest);
  EXPECT_LE(worst, 1e-4);
  EXPECT_GT(largest, 1.0);  // logits of substance, not a block that outputs zeros
}

// Spec 3.11 for the MTP block too: its pairs fed at once or a few at a time give the same logits.
TEST(Mtp, ChunkedPairsEqualOneChunk) {
  const Model& model = tiny_mtp_model();
  std::vector<int32_t> ids(150);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 37 + 11) % 1000);
  std::vector<float> streams;
  SequenceState whole = model.new_sequence(200), parts = model.new_sequence(200);
  model.forward(whole, ids, true, &streams);
  model.forward(parts, ids, true);
  const std::span<const int32_t> next(ids.data() + 1, ids.size() - 1);  // the pair of position i is (X_i, ids[i+1])
  const std::vector<float> all = model.mtp_forward(whole, streams.data(), next, false);
  std::vector<float> pieces;
  const size_t row = streams.size() / ids.size();
  for (size_t at = 0, k = 0; at < next.size(); ++k) {
    const size_t n = std::min<size_t>(std::vector<size_t>{1, 7, 2, 30}[k % 4], next.size() - at);
    const std::vector<float> r = model.mtp_forward(parts, streams.data() + at * row, next.subspan(at, n), false);
    pieces.insert(pieces.end(), r.begin(), r.end());
    at += n;
  }
  EXPECT_EQ(whole.mtp_tokens, 149);
  EXPECT_LE(max_diff(all, pieces), 1e-4);
  // The MTP block reads the main model's streams: other streams, other logits.
  std::vector<float> shifted(streams.begin() + row, streams.end());
  SequenceState other = model.new_sequence(200);
  model.forward(other, ids, true);
  const std::vector<float> moved = model.mtp_forward(other, shifted.data(), next.subspan(0, 148), false);
  EXPECT_GT(max_diff(std::vector<float>(all.begin(), all.begin() + moved.size()), moved), 1e-2);
  EXPECT_THROW(model.mtp_forward(other, streams.data(), next.subspan(0, 3), false), Error);  // past the main model
}

TEST(Mtp, SpeculationGivesPlainDecodingsTokens) {
  const std::vector<int32_t> prompt{5, 17, 99, 42, 5, 17, 99, 42, 5, 17};
  for (const SamplingParams& p : {SamplingParams{}, SamplingParams{0.9f, 1.0f, 0, 3}}) {
    for (bool keep_logits : {false, true}) {
      auto plain_runner = make_cpu_runner(tiny_model(), 256), spec_runner = make_cpu_runner(tiny_mtp_model(), 256);
      GenerateOptions o = options_for(p, DraftMethod::None, keep_logits);
      const GenerateResult plain = Session(*plain_runner).generate(prompt, o);
      o.speculate.method = DraftMethod::Mtp;
      const GenerateResult spec = Session(*spec_runner).generate(prompt, o);
      EXPECT_EQ(spec.output_ids, plain.output_ids) << "T " << p.temperature << " keep " << keep_logits;
      EXPECT_EQ(spec.decode_steps + spec.accepted, plain.decode_steps);
      EXPECT_GT(spec.drafted, 100);  // one draft per step but where the budget ends
      EXPECT_EQ(spec_runner->n_tokens(), plain_runner->n_tokens());
      EXPECT_LE(spec_runner->mtp_pending(), 1);  // fed every step: only the rows after the last draft wait
      if (keep_logits) EXPECT_LE(max_diff(spec.logits, plain.logits), 1e-4);
      std::printf("[mtp] T %.1f: %d of %d drafts kept (random MTP weights)\n", p.temperature, spec.accepted,
                  spec.drafted);
    }
  }
  // Without the block: a clear error, not plain decoding.
  auto runner = make_cpu_runner(tiny_model(), 64);
  EXPECT_THROW(Session(*runner).generate(prompt, options_for({}, DraftMethod::Mtp, false)), Error);
}

// A conversation: the second turn's prompt starts with the token the first turn left unfed, and the MTP block
// catches up on the rows it trails by (also after a turn that generated nothing).
TEST(Mtp, ContinuedConversationMatchesPlainDecoding) {
  std::vector<std::vector<int32_t>> outputs[2];
  for (int spec = 0; spec < 2; ++spec) {
    auto runner = make_cpu_runner(spec ? tiny_mtp_model() : tiny_model(), 256);
    Session session(*runner);
    GenerateOptions o = options_for({}, spec ? DraftMethod::Mtp : DraftMethod::None, false);
    o.max_new_tokens = 0;
    session.generate(std::vector<int32_t>{9, 8, 7}, o);
    o.max_new_tokens = 30;
    const GenerateResult a = session.generate(std::vector<int32_t>{5, 17, 99, 42}, o);
    std::vector<int32_t> turn2{a.output_ids.back(), 7, 8, 9};
    const GenerateResult b = session.generate(turn2, o);
    outputs[spec] = {a.output_ids, b.output_ids};
  }
  EXPECT_EQ(outputs[1], outputs[0]);
}

}  // namespace
