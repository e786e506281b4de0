// SPDX-License-Identifier: MIT
// Spec 3.11: a chunk of n tokens at position p must equal n sequential decode steps. Feeds the same random sequence
// as one prefill, as token-by-token decode, and as irregular chunks, and requires the same logits rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "core/check.h"
#include "model/model.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

// Feeds ids to `state` in chunks of the given sizes (cycled) and returns every row's logits.
std::vector<float> run_chunked(const Model& model, SequenceState& state, const std::vector<int32_t>& ids,
                               const std::vector<int>& chunks) {
  std::vector<float> all;
  size_t at = 0;
  for (size_t c = 0; at < ids.size(); ++c) {
    const size_t n = std::min<size_t>(chunks[c % chunks.size()], ids.size() - at);
    const std::vector<float> rows = model.forward(state, std::span<const int32_t>(ids.data() + at, n), false);
    all.insert(all.end(), rows.begin(), rows.end());
    at += n;
  }
  return all;
}

std::vector<float> run_chunked(const Model& model, const std::vector<int32_t>& ids, const std::vector<int>& chunks) {
  SequenceState state = model.new_sequence(int(ids.size()));
  return run_chunked(model, state, ids, chunks);
}

std::vector<int32_t> random_ids(const Model& model, int length, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, model.config().vocab_size - 1);
  std::vector<int32_t> ids(length);
  for (auto& id : ids) id = token(rng);
  return ids;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  return worst;
}

std::string model_dir(const std::string& name) {
  if (name == "tiny") return std::string(DSV4_SOURCE_DIR) + "/models/tiny";
  return (fs::path(DSV4_TEST_DATA) / "golden" / name).string();
}

void check_equivalence(const std::string& name, int length, Numerics numerics, double tol) {
  const std::string dir = model_dir(name);
  const Model model = Model::load(dir, numerics);
  const std::vector<int32_t> ids = random_ids(model, length, 7);
  const std::vector<float> full = run_chunked(model, ids, {length});
  const double d_decode = max_diff(full, run_chunked(model, ids, {1}));
  const double d_chunks = max_diff(full, run_chunked(model, ids, {5, 1, 3, 64, 2, 130, 7}));
  std::printf("[equivalence] %s len=%d kv=%d idx=%d  full vs decode %.3g, full vs chunks %.3g (tol %.0e)\n",
              name.c_str(), length, int(numerics.kv), int(numerics.indexer), d_decode, d_chunks, tol);
  EXPECT_LE(d_decode, tol);
  EXPECT_LE(d_chunks, tol);
}

}  // namespace

// models/tiny: window 128, CSA 4 with top-8 (binds after 32 entries), HCA 128: 300 tokens wrap the window twice and
// emit two HCA entries.
TEST(Equivalence, TinyF32) { check_equivalence("tiny", 300, {cpu::KvStorage::F32, cpu::IndexerStorage::F32}, 1e-4); }
TEST(Equivalence, TinyProF32) {
  check_equivalence("tiny-pro", 120, {cpu::KvStorage::F32, cpu::IndexerStorage::F32}, 1e-4);
}

namespace {

// Speculative decoding's verify-then-forget: each step feeds `kept` tokens of the sequence followed by `junk`
// random ones (rejected drafts) and rolls the junk back. The kept rows must equal one prefill of the sequence:
// junk that completed a compressor block, wrapped the window ring or shifted an overlapped compressor's halves
// leaves no trace. 300 tokens cross both HCA blocks and 75 CSA blocks with junk on every kind of boundary.
void check_rollback(const std::string& name, int length, Numerics numerics, double tol) {
  const Model model = Model::load(model_dir(name), numerics);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> token(0, model.config().vocab_size - 1);
  std::vector<int32_t> ids(length);
  for (auto& id : ids) id = token(rng);
  const std::vector<float> full = run_chunked(model, ids, {length});

  const std::vector<std::pair<int, int>> steps{{1, 4}, {2, 3}, {1, 1}, {3, 5}, {1, kMaxRollback}, {5, 2}, {1, 0}, {7, 6}};
  SequenceState state = model.new_sequence(length + kMaxRollback);
  std::vector<float> kept;
  const int V = model.config().vocab_size;
  size_t rolled_back = 0;
  for (size_t at = 0, s = 0; at < ids.size(); ++s) {
    const auto [want, junk] = steps[s % steps.size()];
    const size_t n = std::min<size_t>(want, ids.size() - at);
    std::vector<int32_t> fed(ids.begin() + at, ids.begin() + at + n);
    for (int j = 0; j < junk; ++j) fed.push_back(token(rng));
    const std::vector<float> rows = model.forward(state, fed, false);
    kept.insert(kept.end(), rows.begin(), rows.begin() + n * V);
    state.rollback(int64_t(at + n));
    rolled_back += junk;
    at += n;
    ASSERT_EQ(state.n_tokens, int64_t(at));
  }
  const double d = max_diff(full, kept);
  std::printf("[rollback] %s len=%d: %zu junk tokens rolled back; kept rows vs prefill %.3g (tol %.0e)\n",
              name.c_str(), length, rolled_back, d, tol);
  EXPECT_LE(d, tol);
}

}  // namespace

TEST(Equivalence, RollbackLeavesNoTraceTiny) {
  check_rollback("tiny", 300, {cpu::KvStorage::F32, cpu::IndexerStorage::F32}, 1e-4);
}
TEST(Equivalence, RollbackLeavesNoTraceTinyPro) {
  check_rollback("tiny-pro", 120, {cpu::KvStorage::F32, cpu::IndexerStorage::F32}, 1e-4);
}

TEST(Context, RollbackOnlyWithinTheLastForward) {
  const Model model = Model::load(model_dir("tiny"), {cpu::KvStorage::F32, cpu::IndexerStorage::F32});
  SequenceState state = model.new_sequence(64);
  const std::vector<int32_t> first(20, 3), second(3, 4);
  model.forward(state, first, true);
  EXPECT_THROW(state.rollback(21), Error);                  // past the end
  EXPECT_THROW(state.rollback(20 - kMaxRollback - 1), Error);  // more than kMaxRollback back
  model.forward(state, second, true);
  EXPECT_THROW(state.rollback(19), Error);                  // into the forward before
  state.rollback(21);
  state.rollback(20);  // twice within the same forward is fine
  EXPECT_EQ(state.n_tokens, 20);
}

TEST(Context, PromptLongerThanContextIsRejected) {
  const Model model = Model::load(model_dir("tiny"), {cpu::KvStorage::F32, cpu::IndexerStorage::F32});
  SequenceState state = model.new_sequence(8);
  const std::vector<int32_t> ids(9, 3);
  EXPECT_THROW(model.forward(state, ids, true), Error);
  const std::vector<int32_t> bad = {3, 100000};
  EXPECT_THROW(model.forward(state, bad, true), Error);
  EXPECT_EQ(state.n_tokens, 0);
}

namespace {

// The state stores its entries in the bytes the rounding leaves (formats/kv_entry.h): the same chunks over a state
// of fp32 entries must give the same logits bit for bit, in a fraction of the memory.
void check_compact_state(const std::string& name, int length, Numerics numerics, double max_bytes_ratio) {
  const Model model = Model::load(model_dir(name), numerics);
  const std::vector<int32_t> ids = random_ids(model, length, 5);
  SequenceState compact = model.new_sequence(length);
  SequenceState floats = SequenceState::create(model.config(), length, model.has_mtp(), StateCodecs{});
  ASSERT_NE(compact.layers[0].window.codec, KvCodec::F32);
  const std::vector<int> chunks{5, 1, 3, 64, 2, 130, 7};
  const std::vector<float> a = run_chunked(model, compact, ids, chunks), b = run_chunked(model, floats, ids, chunks);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "max diff " << max_diff(a, b);
  const double ratio = double(compact.bytes()) / double(floats.bytes());
  std::printf("[compact-state] %s len=%d kv=%d idx=%d: state %zu bytes against %zu as fp32 (%.3f)\n", name.c_str(),
              length, int(numerics.kv), int(numerics.indexer), compact.bytes(), floats.bytes(), ratio);
  EXPECT_LE(ratio, max_bytes_ratio);
}

}  // namespace

// 300 tokens: the window wraps, CSA entries past the indexer's top-k and two HCA entries, all read back from bytes.
TEST(CompactState, SameLogitsAsFp32EntriesTiny) { check_compact_state("tiny", 300, Numerics{}, 0.8); }
TEST(CompactState, SameLogitsAsFp32EntriesTinyPro) { check_compact_state("tiny-pro", 120, Numerics{}, 0.8); }
TEST(CompactState, SameLogitsAsFp32EntriesBf16) {
  check_compact_state("tiny", 300, {cpu::KvStorage::BF16, cpu::IndexerStorage::BF16}, 0.8);
}
