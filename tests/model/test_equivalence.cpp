// SPDX-License-Identifier: MIT
// Spec 3.11: a chunk of n tokens at position p must equal n sequential decode steps. Feeds the same random sequence
// as one prefill, as token-by-token decode, and as irregular chunks, and requires the same logits rows.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "core/check.h"
#include "model/model.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

std::vector<float> run_chunked(const Model& model, const std::vector<int32_t>& ids, const std::vector<int>& chunks) {
  SequenceState state = model.new_sequence(int(ids.size()));
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
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> token(0, model.config().vocab_size - 1);
  std::vector<int32_t> ids(length);
  for (auto& id : ids) id = token(rng);
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

TEST(Context, PromptLongerThanContextIsRejected) {
  const Model model = Model::load(model_dir("tiny"), {cpu::KvStorage::F32, cpu::IndexerStorage::F32});
  SequenceState state = model.new_sequence(8);
  const std::vector<int32_t> ids(9, 3);
  EXPECT_THROW(model.forward(state, ids, true), Error);
  const std::vector<int32_t> bad = {3, 100000};
  EXPECT_THROW(model.forward(state, bad, true), Error);
  EXPECT_EQ(state.n_tokens, 0);
}
