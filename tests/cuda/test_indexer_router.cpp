// SPDX-License-Identifier: MIT
// The indexer (indexer_scores / indexer_select / indexer_topk) and the MoE router against host references.
//   Indexer: scores against an fp64 evaluation of the formula (1e-5 relative), selected against cpu::top_k_indices
//   of the GPU's own scores (exact ties are bit-exact there), at the decode shape (1 query, 64 heads x 128, 2052
//   keys, top 512), a prefill chunk (64 queries, ~8120 keys), the first chunk of a sequence (0 .. 16 keys), fewer
//   keys than topk, exact ties straddling the threshold, rows longer than the select kernel's shared-memory copy,
//   and shapes off the fast path (head groups, partial dim slabs). Outputs are poisoned first; the entries past
//   n_visible / min(topk, n_visible) must stay untouched. indexer_select alone on crafted rows (±0, negatives,
//   denormals, all equal, sorted, long rows); split launches, a device position and a replayed CUDA graph must give
//   the bits of indexer_topk with pos0.
//   Router: ids and weights against the reference semantics of Model::moe (scoring 0/1/2, bias for selection only,
//   norm_topk, routed_scale, hash layers), E = 256 / 384 and others, one token and 64. ids must match exactly,
//   except where the reference's two candidates lie within 1e-6 of each other (expf may differ from std::exp in
//   its last bits); exact reference ties must go to the lower index. Weights within 1e-6 relative of the reference
//   weights of the experts the GPU picked.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <vector>

#include "cpu/ops.h"
#include "core/check.h"
#include "cuda/device.h"
#include "cuda/gemv.h"
#include "cuda/ops.h"
#include "cuda_test_util.h"
#include "formats/bf16.h"

namespace dsv4 {
namespace {

using namespace cuda_test;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// ---------------------------------------------------------------------------------------------------------
// Indexer

struct IndexerCase {
  int n = 1, heads = 64, dim = 128, ratio = 4, topk = 512, max_entries = 0;
  int64_t pos0 = 0;
  int64_t q_stride = 0;  // 0: heads * dim
  int q_offset = 0;      // floats before q[0] (misaligns the rows)
  float w_scale = 0.0f;  // 0: 1 / sqrt(dim · heads), like the runner
  int sample = 1;        // fp64 score check on keys s % sample == t % sample (plus each row's first / last 16)
  bool bf16_exact = false;  // q and keys rounded to bf16, and IndexerTopkParams::bf16_exact set
};

struct IndexerInputs {
  IndexerCase c;
  std::vector<float> q, w, keys;
  int visible(int t) const { return int(std::min<int64_t>((c.pos0 + t + 1) / c.ratio, c.max_entries)); }
  int64_t q_stride() const { return c.q_stride ? c.q_stride : int64_t(c.heads) * c.dim; }
  float w_scale() const { return c.w_scale != 0.0f ? c.w_scale : 1.0f / std::sqrt(float(c.dim) * c.heads); }
};

// Random q, signed head weights (mixed-sign scores), random keys; `pool` > 0 draws every key from that many
// distinct vectors and `zero_fraction` of them become zero vectors (score exactly 0): exact ties.
IndexerInputs make_inputs(const IndexerCase& c, uint32_t seed, int pool = 0, double zero_fraction = 0) {
  std::mt19937 rng(seed);
  IndexerInputs in;
  in.c = c;
  const int64_t stride = in.q_stride();
  in.q = random_vector(size_t(c.q_offset + stride * c.n), rng);
  in.w = random_vector(size_t(c.n) * c.heads, rng, -0.5f, 1.0f);
  in.keys = random_vector(size_t(c.max_entries) * c.dim, rng);
  std::uniform_int_distribution<int> pick(0, std::max(pool, 1) - 1);
  std::uniform_real_distribution<double> u(0, 1);
  if (pool > 0)
    for (int s = pool; s < c.max_entries; ++s)
      std::copy_n(&in.keys[size_t(pick(rng)) * c.dim], c.dim, &in.keys[size_t(s) * c.dim]);
  if (zero_fraction > 0)
    for (int s = 0; s < c.max_entries; ++s)
      if (u(rng) < zero_fraction) std::fill_n(&in.keys[size_t(s) * c.dim], c.dim, 0.0f);
  if (c.bf16_exact) {
    for (float& v : in.q) v = round_bf16(v);
    for (float& v : in.keys) v = round_bf16(v);
  }
  return in;
}

enum class Launch { Topk, Split, PosDevice };

struct IndexerOutputs {
  std::vector<float> scores;      // [n, max_entries]
  std::vector<int32_t> selected;  // [n, topk]
};

// tensor_cores: set to whether indexer_scores took the tensor-core kernel.
IndexerOutputs run_indexer(const IndexerInputs& in, Launch how, bool* tensor_cores = nullptr) {
  const IndexerCase& c = in.c;
  DeviceBuffer dq = to_device(in.q), dw = to_device(in.w), dk = to_device(in.keys);
  DeviceBuffer scores = nan_buffer(size_t(c.n) * c.max_entries);
  DeviceBuffer selected(size_t(c.n) * c.topk * sizeof(int32_t));
  selected.fill_bytes(0xff);
  DeviceBuffer pos = to_device(std::vector<int64_t>{c.pos0});
  gpu::IndexerTopkParams p;
  p.bf16_exact = c.bf16_exact;
  p.q = dq.as<float>() + c.q_offset;
  p.q_token_stride = in.q_stride();
  p.w = dw.as<float>();
  p.w_scale = in.w_scale();
  p.keys = dk.as<float>();
  p.scores = scores.as<float>();
  p.selected = selected.as<int32_t>();
  p.n = c.n;
  p.heads = c.heads;
  p.dim = c.dim;
  p.ratio = c.ratio;
  p.topk = c.topk;
  p.max_entries = c.max_entries;
  p.pos0 = c.pos0;
  if (tensor_cores) *tensor_cores = gpu::indexer_scores_on_tensor_cores(p);
  switch (how) {
    case Launch::Topk: gpu::indexer_topk(p, nullptr); break;
    case Launch::Split:
      gpu::indexer_scores(p, nullptr);
      gpu::indexer_select(p, nullptr);
      break;
    case Launch::PosDevice:
      p.pos0 = -1000000;  // must not be used
      p.pos_device = pos.as<int64_t>();
      gpu::indexer_topk(p, nullptr);
      break;
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {to_host<float>(scores, size_t(c.n) * c.max_entries), to_host<int32_t>(selected, size_t(c.n) * c.topk)};
}

double reference_score(const IndexerInputs& in, int t, int s) {
  const IndexerCase& c = in.c;
  const float* qt = &in.q[size_t(c.q_offset + in.q_stride() * t)];
  const float* k = &in.keys[size_t(s) * c.dim];
  double acc = 0;
  for (int h = 0; h < c.heads; ++h) {
    double dot = 0;
    for (int i = 0; i < c.dim; ++i) dot += double(qt[size_t(h) * c.dim + i]) * k[i];
    acc += double(in.w[size_t(t) * c.heads + h]) * in.w_scale() * std::max(dot, 0.0);
  }
  return acc;
}

// selected[t] must be top_k_indices of the GPU's score row t, in ascending index order (or, with
// set_indexer_select_index_order(false), in top_k_indices' own order); the rest of the row untouched (-1).
void check_selected(const std::vector<float>& scores, const std::vector<int32_t>& selected, int n, int max_entries,
                    int topk, const std::function<int(int)>& visible, const char* what) {
  int bad = 0, untouched_bad = 0;
  for (int t = 0; t < n; ++t) {
    const int nv = visible(t);
    const std::vector<float> row(scores.begin() + size_t(t) * max_entries,
                                 scores.begin() + size_t(t) * max_entries + nv);
    std::vector<int> want = cpu::top_k_indices(row, topk);
    if (gpu::indexer_select_index_order()) std::sort(want.begin(), want.end());
    const int32_t* got = &selected[size_t(t) * topk];
    for (size_t i = 0; i < want.size(); ++i)
      if (got[i] != want[i] && bad++ < 5)
        ADD_FAILURE() << what << ": token " << t << " (n_visible " << nv << ") rank " << i << ": got " << got[i]
                      << ", want " << want[i];
    for (int i = int(want.size()); i < topk; ++i)
      if (got[i] != -1 && untouched_bad++ < 5)
        ADD_FAILURE() << what << ": token " << t << " entry " << i << " past min(topk, n_visible) was written";
  }
  EXPECT_EQ(bad, 0) << what << ": selected entries differ from top_k_indices of the GPU scores";
  EXPECT_EQ(untouched_bad, 0) << what;
}

void check_indexer(const IndexerInputs& in, const IndexerOutputs& out, const char* what) {
  const IndexerCase& c = in.c;
  int bad = 0, checked = 0, written_past = 0;
  double worst = 0;
  for (int t = 0; t < c.n; ++t) {
    const int nv = in.visible(t);
    const float* row = &out.scores[size_t(t) * c.max_entries];
    for (int s = 0; s < nv; ++s) {
      if (!(s % c.sample == t % c.sample || s < 16 || s >= nv - 16)) continue;
      const double want = reference_score(in, t, s);
      const double err = std::fabs(double(row[s]) - want) / std::max(1.0, std::fabs(want));
      ++checked;
      worst = std::max(worst, std::isnan(err) ? INFINITY : err);
      if (!(err <= 1e-5) && bad++ < 5)
        ADD_FAILURE() << what << ": score[" << t << ", " << s << "] = " << row[s] << ", want " << want;
    }
    for (int s = nv; s < c.max_entries; ++s) written_past += bits(row[s]) != 0xffffffffu;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << checked << " checked scores off by more than 1e-5";
  EXPECT_EQ(written_past, 0) << what << ": scores past n_visible were written";
  check_selected(out.scores, out.selected, c.n, c.max_entries, c.topk, [&](int t) { return in.visible(t); }, what);
  std::printf("[indexer] %s: n=%d heads=%d dim=%d topk=%d n_visible %d..%d: %d scores checked, max rel err %.2g\n",
              what, c.n, c.heads, c.dim, c.topk, in.visible(0), in.visible(c.n - 1), checked, worst);
}

// Same bits (scores and selected) from two runs.
void expect_same(const IndexerOutputs& a, const IndexerOutputs& b, const char* what) {
  int diff_scores = 0, diff_selected = 0;
  for (size_t i = 0; i < a.scores.size(); ++i) diff_scores += bits(a.scores[i]) != bits(b.scores[i]);
  for (size_t i = 0; i < a.selected.size(); ++i) diff_selected += a.selected[i] != b.selected[i];
  EXPECT_EQ(diff_scores, 0) << what << ": scores differ";
  EXPECT_EQ(diff_selected, 0) << what << ": selected differ";
}

IndexerCase decode_case() {
  IndexerCase c;  // V4-Flash at an 8K context: pos 8210 -> 2052 visible keys
  c.n = 1;
  c.pos0 = 8210;
  c.max_entries = 2054;
  c.q_stride = 64 * 128 + 96;  // the runner's q rows are slices of a wider projection
  c.q_offset = 3;
  return c;
}

// The first chunk of a sequence: rows with no key, fewer keys than topk, exactly topk, more.
IndexerCase first_chunk_case() {
  IndexerCase c;
  c.n = 64;
  c.pos0 = 0;  // n_visible = (t + 1) / 4: 0 .. 16
  c.heads = 4;
  c.topk = 8;
  c.max_entries = 64;
  return c;
}

IndexerCase fewer_keys_case() {
  IndexerCase c;
  c.n = 4;
  c.pos0 = 1200;  // 300 keys < 512
  c.max_entries = 512;
  return c;
}

TEST(CudaIndexer, DecodeShape) {
  DSV4_REQUIRE_CUDA();
  const IndexerInputs in = make_inputs(decode_case(), 1);
  check_indexer(in, run_indexer(in, Launch::Topk), "decode");
}

TEST(CudaIndexer, SplitLaunchesAndDevicePositionMatchTopk) {
  DSV4_REQUIRE_CUDA();
  const IndexerInputs decode = make_inputs(decode_case(), 2, 300);
  const IndexerOutputs want = run_indexer(decode, Launch::Topk);
  expect_same(run_indexer(decode, Launch::Split), want, "decode, split launches");
  expect_same(run_indexer(decode, Launch::PosDevice), want, "decode, pos_device");
  IndexerCase c;
  c.n = 5;
  c.pos0 = 150;
  c.topk = 7;
  c.heads = 3;
  c.dim = 64;
  c.max_entries = 64;
  const IndexerInputs small = make_inputs(c, 3, 10);
  const IndexerOutputs small_want = run_indexer(small, Launch::Topk);
  check_indexer(small, small_want, "small, 3 heads");
  expect_same(run_indexer(small, Launch::Split), small_want, "small, split launches");
  expect_same(run_indexer(small, Launch::PosDevice), small_want, "small, pos_device");
}

// One capture with pos_device, replayed at two positions, against direct launches at those positions. max_entries
// far above n_visible, as in the runner: the grid covers it and the blocks past n_visible exit.
TEST(CudaIndexer, GraphReplayReadsThePosition) {
  DSV4_REQUIRE_CUDA();
  IndexerCase c = decode_case();
  c.max_entries = 32768;
  IndexerInputs in = make_inputs(c, 4, 500);
  DeviceBuffer dq = to_device(in.q), dw = to_device(in.w), dk = to_device(in.keys);
  DeviceBuffer scores(size_t(c.max_entries) * sizeof(float)), selected(size_t(c.topk) * sizeof(int32_t));
  DeviceBuffer pos(sizeof(int64_t));
  gpu::IndexerTopkParams p;
  p.q = dq.as<float>() + c.q_offset;
  p.q_token_stride = in.q_stride();
  p.w = dw.as<float>();
  p.w_scale = in.w_scale();
  p.keys = dk.as<float>();
  p.scores = scores.as<float>();
  p.selected = selected.as<int32_t>();
  p.n = 1;
  p.heads = c.heads;
  p.dim = c.dim;
  p.ratio = c.ratio;
  p.topk = c.topk;
  p.max_entries = c.max_entries;
  p.pos_device = pos.as<int64_t>();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  run_indexer(in, Launch::Topk);  // first launches (function attributes) outside the capture, as in the runner
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  gpu::indexer_topk(p, stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const int64_t position : {int64_t(8210), int64_t(30001), int64_t(2)}) {
    scores.fill_bytes(0xff);
    selected.fill_bytes(0xff);
    pos.upload(&position, sizeof position);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the memsets ran on the legacy stream
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const IndexerOutputs replayed{to_host<float>(scores, c.max_entries), to_host<int32_t>(selected, c.topk)};
    in.c.pos0 = position;
    const IndexerOutputs direct = run_indexer(in, Launch::Topk);
    expect_same(replayed, direct, "graph replay");
    check_selected(direct.scores, direct.selected, 1, c.max_entries, c.topk, [&](int t) { return in.visible(t); },
                   "graph replay, direct");
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A 64-token prefill chunk at a 32K context: ~8120 keys per query, the grid's blocks walk several tiles each.
TEST(CudaIndexer, PrefillShape) {
  DSV4_REQUIRE_CUDA();
  IndexerCase c;
  c.n = 64;
  c.pos0 = 32447;  // n_visible 8112 .. 8127
  c.max_entries = 8192;
  c.sample = 8;
  const IndexerInputs in = make_inputs(c, 5);
  check_indexer(in, run_indexer(in, Launch::Topk), "prefill");
}

TEST(CudaIndexer, FirstChunkOfASequence) {
  DSV4_REQUIRE_CUDA();
  const IndexerInputs in = make_inputs(first_chunk_case(), 6);
  check_indexer(in, run_indexer(in, Launch::Topk), "first chunk");
}

TEST(CudaIndexer, FewerKeysThanTopK) {
  DSV4_REQUIRE_CUDA();
  IndexerCase c = fewer_keys_case();
  const IndexerInputs a = make_inputs(c, 7);
  check_indexer(a, run_indexer(a, Launch::Topk), "fewer keys than topk");
  c.topk = 2048;  // the largest topk: two sort positions per thread
  c.pos0 = 4 * 1500;
  c.max_entries = 1600;
  const IndexerInputs b = make_inputs(c, 8, 200);
  check_indexer(b, run_indexer(b, Launch::Topk), "topk 2048, 1500 keys");
  c.pos0 = 4 * 5000;
  c.max_entries = 5004;
  const IndexerInputs d = make_inputs(c, 9, 1000);
  check_indexer(d, run_indexer(d, Launch::Topk), "topk 2048, 5000 keys");
}

// Exact ties: keys drawn from a small pool (each score ~50 times, the threshold inside a run of equal scores),
// and mostly zero keys (a run of ~1600 zero scores across the threshold).
TEST(CudaIndexer, ExactTiesStraddleThreshold) {
  DSV4_REQUIRE_CUDA();
  IndexerCase c = decode_case();
  c.n = 3;
  const IndexerInputs pooled = make_inputs(c, 10, 40);
  check_indexer(pooled, run_indexer(pooled, Launch::Topk), "40 distinct keys");
  const IndexerInputs zeros = make_inputs(c, 11, 0, 0.8);
  const IndexerOutputs out = run_indexer(zeros, Launch::Topk);
  check_indexer(zeros, out, "80% zero keys");
  int positive = 0, zero = 0;
  for (int s = 0; s < zeros.visible(0); ++s) positive += out.scores[s] > 0, zero += out.scores[s] == 0;
  EXPECT_LT(positive, c.topk) << "the case should put the threshold inside the zeros";
  EXPECT_GE(positive + zero, c.topk);
}

// Rows longer than the select kernel keeps in shared memory (16384 scores): ranked from the global scores.
TEST(CudaIndexer, RowsLongerThanSharedMemory) {
  DSV4_REQUIRE_CUDA();
  IndexerCase c;
  c.n = 2;
  c.heads = 8;
  c.dim = 64;
  c.pos0 = 4 * 20000 - 1;  // 20000, 20000 keys
  c.max_entries = 20480;
  const IndexerInputs in = make_inputs(c, 12, 3000);
  check_indexer(in, run_indexer(in, Launch::Topk), "20000 keys");
}

// bf16 values (the official FP4 / bf16 storage) at the V4 shape: chunks of >= 16 queries score on tensor cores, which
// must meet the same fp64 reference (1e-5) and top-k checks as the fp32 kernel. Chunks: 512 queries at an 8K context
// (the prefill's), 37 queries from position 0 (a partial last group, queries with no key), 16 queries whose keys cross
// a 64-key tile into a partial one, q rows at an odd float offset (not 8-byte aligned: the fp32 kernel). The same
// inputs without bf16_exact run the fp32 kernel; its scores must agree with the tensor cores' within the tolerance.
TEST(CudaIndexer, TensorCoreScoresOfBf16Values) {
  DSV4_REQUIRE_CUDA();
  struct Chunk {
    int n;
    int64_t pos0;
    int max_entries, sample, q_offset;
    bool tensor_cores;
    const char* what;
  };
  for (const Chunk k : {Chunk{512, 7680, 2112, 61, 2, true, "512 queries at 8K"},
                        Chunk{37, 0, 64, 1, 0, true, "37 queries from position 0"},
                        Chunk{16, 250, 70, 1, 2, true, "16 queries, keys 62 .. 66"},
                        Chunk{64, 8011, 2100, 7, 3, false, "q at an odd offset"}}) {
    IndexerCase c;
    c.n = k.n;
    c.pos0 = k.pos0;
    c.max_entries = k.max_entries;
    c.sample = k.sample;
    c.q_stride = 64 * 128 + 96;
    c.q_offset = k.q_offset;
    c.bf16_exact = true;
    const IndexerInputs in = make_inputs(c, 40 + k.n);
    bool tensor_cores = false;
    const IndexerOutputs out = run_indexer(in, Launch::Topk, &tensor_cores);
    EXPECT_EQ(tensor_cores, k.tensor_cores) << k.what;
    check_indexer(in, out, k.what);
    IndexerInputs fp32 = in;
    fp32.c.bf16_exact = false;
    const IndexerOutputs want = run_indexer(fp32, Launch::Topk);
    double worst = 0;
    for (int t = 0; t < c.n; ++t)
      for (int s = 0; s < in.visible(t); ++s) {
        const size_t i = size_t(t) * c.max_entries + s;
        const double want_i = want.scores[i];
        const double err = std::fabs(out.scores[i] - want_i) / std::max(1.0, std::fabs(want_i));
        worst = std::max(worst, err);
      }
    EXPECT_LE(worst, 2e-5) << k.what << ": tensor-core and fp32 scores";
  }
}

// Off the fast path: few heads, several 64-head groups, dims in several slabs (one partial), the largest dim.
TEST(CudaIndexer, OddShapes) {
  DSV4_REQUIRE_CUDA();
  struct Shape {
    int heads, dim;
  };
  for (const Shape s : {Shape{3, 64}, Shape{72, 160}, Shape{24, 512}, Shape{64, 32}, Shape{96, 128}}) {
    IndexerCase c;
    c.n = 3;
    c.heads = s.heads;
    c.dim = s.dim;
    c.topk = 64;
    c.pos0 = 2000;  // ~500 keys
    c.max_entries = 512;
    const IndexerInputs in = make_inputs(c, 13 + s.heads + s.dim, 100);
    char what[64];
    std::snprintf(what, sizeof what, "%d heads x %d", s.heads, s.dim);
    check_indexer(in, run_indexer(in, Launch::Topk), what);
  }
}

// indexer_select alone on crafted rows of `values` (n_visible = values.size()); the scores past it are NaN and must
// not be read.
void check_select_row(const std::vector<float>& values, int topk, const char* what) {
  const int nv = int(values.size()), max_entries = nv + 7;
  std::vector<float> row(max_entries, std::nanf(""));
  std::copy(values.begin(), values.end(), row.begin());
  DeviceBuffer scores = to_device(row);
  DeviceBuffer selected(size_t(topk) * sizeof(int32_t));
  selected.fill_bytes(0xff);
  gpu::IndexerTopkParams p;
  p.scores = scores.as<float>();
  p.selected = selected.as<int32_t>();
  p.n = 1;
  p.ratio = 1;
  p.topk = topk;
  p.max_entries = max_entries;
  p.pos0 = nv - 1;  // n_visible = pos0 + 1
  gpu::indexer_select(p, nullptr);
  sync();
  const std::vector<int32_t> got = to_host<int32_t>(selected, topk);
  check_selected(row, got, 1, max_entries, topk, [&](int) { return nv; }, what);
}

// Both orders of the picks: the same set, each in its declared order (check_selected), on rows with ties.
TEST(CudaIndexer, SelectBothOrders) {
  DSV4_REQUIRE_CUDA();
  const bool before = gpu::indexer_select_index_order();
  for (const bool index_order : {false, true}) {
    gpu::set_indexer_select_index_order(index_order);
    std::mt19937 rng(61);
    for (const int nv : {300, 2048, 20000}) {
      std::vector<float> row(nv);
      for (float& v : row) v = float(int(rng() % 64)) / 8.0f;  // many ties
      char what[64];
      std::snprintf(what, sizeof what, "order %s n_visible %d", index_order ? "index" : "score", nv);
      check_select_row(row, 512, what);
    }
  }
  gpu::set_indexer_select_index_order(before);
}


TEST(CudaIndexer, SelectOnCraftedScores) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(20);
  auto from_set = [&](int n, const std::vector<float>& set) {
    std::uniform_int_distribution<size_t> pick(0, set.size() - 1);
    std::vector<float> v(n);
    for (float& x : v) x = set[pick(rng)];
    return v;
  };
  auto grid = [&](int n, int lo, int hi, float step) {  // integers in [lo, hi] times step: many ties
    std::uniform_int_distribution<int> pick(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = float(pick(rng)) * step;
    return v;
  };
  check_select_row(random_vector(2052, rng), 512, "random");
  check_select_row(from_set(3000, {-1.5f, -0.0f, 0.0f, 0.25f, 3.0f}), 512, "5 values with +-0");
  check_select_row(from_set(3000, {-1.5f, -0.0f, 0.0f, 0.25f, 3.0f}), 1000, "5 values with +-0, topk 1000");
  check_select_row(std::vector<float>(5000, 0.5f), 512, "all equal");
  check_select_row(from_set(700, {-0.0f, 0.0f}), 300, "only +-0");
  check_select_row(from_set(1000, {1e-40f, -1e-40f, 1e-30f, -1e-30f, 3e38f, -3e38f, 1.0f, -1.0f, 0.0f}), 100,
                   "denormals and extremes");
  check_select_row(random_vector(3000, rng, -10.0f, -1.0f), 512, "negative");
  check_select_row(grid(20000, -50, 50, 0.25f), 512, "20000 scores (global), ties");
  check_select_row(grid(20000, -50, 50, 0.25f), 2048, "20000 scores (global), ties, topk 2048");
  check_select_row(grid(16384, -20, 20, 0.5f), 2048, "16384 scores (the cache's size)");
  check_select_row(grid(16385, -20, 20, 0.5f), 2048, "16385 scores (one past the cache)");
  std::vector<float> ascending(4096), descending(4096);
  for (int i = 0; i < 4096; ++i) ascending[i] = float(i) / 7, descending[i] = -float(i) / 7;
  check_select_row(ascending, 2048, "ascending");
  check_select_row(descending, 2048, "descending");
  check_select_row(random_vector(512, rng), 512, "n_visible == topk");
  check_select_row(grid(33, 0, 3, 1.0f), 33, "33 of 33");
  check_select_row(grid(40, 0, 3, 1.0f), 33, "33 of 40");
  check_select_row({0.75f}, 1, "one key");
  check_select_row(random_vector(100, rng), 1, "topk 1");
  check_select_row({}, 16, "no key");
}

// ---------------------------------------------------------------------------------------------------------
// Router

struct RouterCase {
  int n = 1, E = 256, k = 6, scoring = 0;
  bool bias = false, norm = true, hash = false;
  float routed_scale = 2.5f;
};

struct RouterInputs {
  RouterCase c;
  std::vector<float> logits, bias;
  std::vector<int32_t> tid2eid, tokens;
};

constexpr int kVocab = 1000;

RouterInputs make_router_inputs(const RouterCase& c, std::mt19937& rng, bool grid_logits) {
  RouterInputs in;
  in.c = c;
  if (grid_logits) {  // multiples of 1/8 in [-4, 4]: ~65 distinct values over E experts, many exact ties
    std::uniform_int_distribution<int> pick(-32, 32);
    in.logits.resize(size_t(c.n) * c.E);
    for (float& x : in.logits) x = float(pick(rng)) / 8;
  } else {
    in.logits = random_vector(size_t(c.n) * c.E, rng, -4.0f, 4.0f);
  }
  if (c.bias) in.bias = grid_logits ? std::vector<float>(c.E, 0.125f) : random_vector(c.E, rng, -0.1f, 0.1f);
  if (c.hash) {
    std::vector<int32_t> experts(c.E);
    for (int v = 0; v < kVocab; ++v) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      in.tid2eid.insert(in.tid2eid.end(), experts.begin(), experts.begin() + c.k);
    }
  }
  std::uniform_int_distribution<int32_t> token(0, kVocab - 1);
  in.tokens.resize(c.n);
  for (int32_t& t : in.tokens) t = token(rng);
  return in;
}

// Model::moe's router: s from the logits, picks by hash or top-k of s + bias, weights from s.
std::vector<float> reference_scores(const RouterInputs& in, int t) {
  const int E = in.c.E;
  std::vector<float> s(in.logits.begin() + size_t(t) * E, in.logits.begin() + size_t(t + 1) * E);
  if (in.c.scoring == 2) {
    const float mx = *std::max_element(s.begin(), s.end());
    float sum = 0;
    for (int e = 0; e < E; ++e) sum += (s[e] = std::exp(s[e] - mx));
    for (int e = 0; e < E; ++e) s[e] /= sum;
  } else {
    for (float& x : s) x = in.c.scoring == 1 ? 1.0f / (1.0f + std::exp(-x)) : std::sqrt(cpu::softplus(x));
  }
  return s;
}

// The router's inputs on the device, and its parameters for outputs ids / weights.
struct RouterDevice {
  DeviceBuffer logits, bias, tid2eid, tokens;
  explicit RouterDevice(const RouterInputs& in)
      : logits(to_device(in.logits)), bias(to_device(in.bias)), tid2eid(to_device(in.tid2eid)),
        tokens(to_device(in.tokens)) {}
  gpu::RouterParams params(const RouterCase& c, DeviceBuffer& ids, DeviceBuffer& weights) const {
    gpu::RouterParams p;
    p.logits = logits.as<float>();
    p.bias = c.bias ? bias.as<float>() : nullptr;
    p.tid2eid = c.hash ? tid2eid.as<int32_t>() : nullptr;
    p.tokens = tokens.as<int32_t>();
    p.n = c.n;
    p.experts = c.E;
    p.k = c.k;
    p.scoring = c.scoring;
    p.norm_topk = c.norm;
    p.routed_scale = c.routed_scale;
    p.ids = ids.as<int32_t>();
    p.weights = weights.as<float>();
    return p;
  }
};

void check_router(const RouterInputs& in, const char* what) {
  const RouterCase& c = in.c;
  const RouterDevice device(in);
  DeviceBuffer ids(size_t(c.n) * c.k * sizeof(int32_t));
  DeviceBuffer weights = nan_buffer(size_t(c.n) * c.k);
  ids.fill_bytes(0xff);
  gpu::router(device.params(c, ids, weights), nullptr);
  sync();
  const std::vector<int32_t> got_ids = to_host<int32_t>(ids, size_t(c.n) * c.k);
  const std::vector<float> got_w = to_host<float>(weights, size_t(c.n) * c.k);
  int bad_ids = 0, near_ties = 0, bad_w = 0;
  for (int t = 0; t < c.n; ++t) {
    const std::vector<float> s = reference_scores(in, t);
    std::vector<float> biased = s;
    if (c.bias)
      for (int e = 0; e < c.E; ++e) biased[e] += in.bias[e];
    std::vector<int> want;
    if (c.hash) {
      const int32_t* row = in.tid2eid.data() + size_t(in.tokens[t]) * c.k;
      want.assign(row, row + c.k);
    } else {
      want = cpu::top_k_indices(biased, c.k);
    }
    const int32_t* g = &got_ids[size_t(t) * c.k];
    std::vector<int32_t> distinct(g, g + c.k);
    std::sort(distinct.begin(), distinct.end());
    const bool valid = std::adjacent_find(distinct.begin(), distinct.end()) == distinct.end() && distinct[0] >= 0 &&
                       distinct.back() < c.E;
    for (int i = 0; i < c.k; ++i) {
      if (g[i] == want[i]) continue;
      // Tolerated only as a last-bits flip between two different reference values (never on a hash layer).
      const bool near = !c.hash && valid && biased[g[i]] != biased[want[i]] &&
                        std::fabs(biased[g[i]] - biased[want[i]]) <= 1e-6f * std::fabs(biased[want[i]]);
      if (near) ++near_ties;
      else if (bad_ids++ < 5)
        ADD_FAILURE() << what << ": token " << t << " pick " << i << ": got expert " << g[i] << ", want "
                      << want[i];
    }
    if (!valid) continue;
    float sum = 0;  // the reference weights of the GPU's picks, summed in pick order
    for (int i = 0; i < c.k; ++i) sum += s[g[i]];
    for (int i = 0; i < c.k; ++i) {
      const float want_w = (c.norm ? s[g[i]] / sum : s[g[i]]) * c.routed_scale;
      const float w = got_w[size_t(t) * c.k + i];
      if (!(std::fabs(w - want_w) <= 1e-6f * std::fabs(want_w)) && bad_w++ < 5)
        ADD_FAILURE() << what << ": token " << t << " weight " << i << ": got " << w << ", want " << want_w;
    }
  }
  EXPECT_EQ(bad_ids, 0) << what;
  EXPECT_EQ(bad_w, 0) << what;
  EXPECT_LE(near_ties, 2) << what << ": too many near-tie flips for last-bit differences";
  if (near_ties) std::printf("[router] %s: %d picks flipped between values within 1e-6\n", what, near_ties);
}

TEST(CudaRouter, MatchesReference) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(30);
  for (const int E : {256, 384})
    for (const int n : {1, 64})
      for (const int scoring : {0, 1, 2})
        for (const bool bias : {false, true})
          for (const bool norm : {true, false}) {
            RouterCase c;
            c.n = n, c.E = E, c.scoring = scoring, c.bias = bias, c.norm = norm;
            char what[96];
            std::snprintf(what, sizeof what, "E=%d n=%d scoring=%d bias=%d norm=%d", E, n, scoring, int(bias),
                          int(norm));
            check_router(make_router_inputs(c, rng, false), what);
          }
}

// Other expert counts (each register-array size of the kernel) and k up to its limit of 16.
TEST(CudaRouter, OtherSizes) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(31);
  struct Size {
    int E, k;
  };
  for (const Size s : {Size{8, 2}, Size{16, 4}, Size{32, 6}, Size{100, 16}, Size{512, 8}, Size{1000, 6},
                       Size{1024, 16}, Size{6, 6}}) {
    RouterCase c;
    c.n = 7, c.E = s.E, c.k = s.k, c.bias = true;
    char what[64];
    std::snprintf(what, sizeof what, "E=%d k=%d", s.E, s.k);
    check_router(make_router_inputs(c, rng, false), what);
  }
}

TEST(CudaRouter, HashRouting) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(32);
  for (const int E : {256, 384})
    for (const int scoring : {0, 2})
      for (const int n : {1, 64}) {
        RouterCase c;
        c.n = n, c.E = E, c.scoring = scoring, c.hash = true;
        char what[64];
        std::snprintf(what, sizeof what, "hash E=%d n=%d scoring=%d", E, n, scoring);
        check_router(make_router_inputs(c, rng, false), what);
      }
}

// Logits on a 1/8 grid: many exactly equal scores (also with a bias that keeps them equal), which must go to the
// lower expert index.
TEST(CudaRouter, TiesGoToTheLowerIndex) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(33);
  for (const int E : {256, 384})
    for (const int scoring : {0, 1, 2})
      for (const bool bias : {false, true}) {
        RouterCase c;
        c.n = 64, c.E = E, c.scoring = scoring, c.bias = bias;
        char what[64];
        std::snprintf(what, sizeof what, "ties E=%d scoring=%d bias=%d", E, scoring, int(bias));
        const RouterInputs in = make_router_inputs(c, rng, true);
        check_router(in, what);
      }
  // Every expert equal: the picks are 0..k-1.
  RouterCase c;
  c.n = 2, c.E = 256;
  RouterInputs in = make_router_inputs(c, rng, false);
  std::fill(in.logits.begin(), in.logits.end(), 0.5f);
  check_router(in, "all equal");
}

// moe_route_and_slots against gpu::router then moe_slots: the same bits in the ids, weights, pair weights and every
// slot array, for decode-sized steps, hash and scored layers, with and without a grouped shared expert. gate_k > 0:
// moe_gate_route_and_slots from x [n, gate_k] and a gate W [E, gate_k] (random) against gpu::linear_f32 then the two
// launches, the logits compared too; it runs twice on one ticket, which it must leave at 0.
void check_route_and_slots(const RouterInputs& in, bool shared, const char* what, int gate_k = 0) {
  const RouterCase& c = in.c;
  const RouterDevice device(in);
  std::mt19937 rng(uint32_t(c.n * 1000 + c.E));
  const size_t logit_count = size_t(c.n) * c.E;
  DeviceBuffer x, w, ticket, logits_separate, logits_fused;
  if (gate_k > 0) {
    x = to_device(random_vector(size_t(c.n) * gate_k, rng, -2.0f, 2.0f));
    w = to_device(random_vector(size_t(c.E) * gate_k, rng, -0.05f, 0.05f));
    ticket = DeviceBuffer(4);
    ticket.fill_bytes(0);
    logits_separate = nan_buffer(logit_count);
    logits_fused = nan_buffer(logit_count);
  }
  const int experts = c.E + (shared ? 1 : 0), pairs = c.n * (c.k + (shared ? 1 : 0));
  struct Outputs {
    DeviceBuffer ids, weights, pair_weights, count, expert, offset, row_order;
  };
  auto outputs = [&] {
    Outputs o{DeviceBuffer(size_t(c.n) * c.k * 4), nan_buffer(size_t(c.n) * c.k), nan_buffer(size_t(pairs)),
              DeviceBuffer(4), DeviceBuffer(size_t(experts) * 4), DeviceBuffer(size_t(experts + 1) * 4),
              DeviceBuffer(size_t(pairs) * 4)};
    for (DeviceBuffer* b : {&o.ids, &o.count, &o.expert, &o.offset, &o.row_order}) b->fill_bytes(0xff);
    return o;
  };
  auto params = [&](Outputs& o) {
    const gpu::RouterParams r = device.params(c, o.ids, o.weights);
    MoeSlotsParams m;
    m.ids = r.ids;
    m.n = c.n;
    m.k = c.k;
    m.experts = experts;
    m.slots = {o.count.as<int32_t>(), o.expert.as<int32_t>(), o.offset.as<int32_t>(), o.row_order.as<int32_t>()};
    if (shared) {
      m.shared_expert = c.E;
      m.weights = r.weights;
      m.pair_weights = o.pair_weights.as<float>();
    }
    return std::pair{r, m};
  };
  Outputs separate = outputs(), fused = outputs();
  auto [r1, m1] = params(separate);
  auto [r2, m2] = params(fused);
  if (gate_k > 0) {
    r1.logits = logits_separate.as<float>();
    r2.logits = logits_fused.as<float>();
    gpu::linear_f32({x.as<float>(), w.as<float>(), logits_separate.as<float>(), c.n, c.E, gate_k, 1.0f}, nullptr);
  }
  gpu::router(r1, nullptr);
  moe_slots(m1);
  if (gate_k > 0) {
    const gpu::LinearF32Params gate{x.as<float>(), w.as<float>(), logits_fused.as<float>(), c.n, c.E, gate_k, 1.0f};
    ASSERT_TRUE(moe_gate_fits(gate)) << what;
    for (int twice = 0; twice < 2; ++twice) moe_gate_route_and_slots(gate, r2, m2, ticket.as<uint32_t>());
  } else {
    moe_route_and_slots(r2, m2);
  }
  sync();
  if (gate_k > 0) {
    uint32_t left = 1;
    ticket.download(&left, 4);
    EXPECT_EQ(left, 0u) << what << ": the ticket must be left at 0";
  }
  auto same = [&](const DeviceBuffer& a, const DeviceBuffer& b, size_t bytes, const char* name) {
    std::vector<uint8_t> x(bytes), y(bytes);
    a.download(x.data(), bytes);
    b.download(y.data(), bytes);
    EXPECT_EQ(x, y) << what << ": " << name << " differs";
  };
  if (gate_k > 0) same(logits_separate, logits_fused, logit_count * 4, "gate logits");
  same(separate.ids, fused.ids, size_t(c.n) * c.k * 4, "ids");
  same(separate.weights, fused.weights, size_t(c.n) * c.k * 4, "weights");
  same(separate.count, fused.count, 4, "slot count");
  int32_t slots_used = 0;
  fused.count.download(&slots_used, 4);
  ASSERT_GT(slots_used, 0) << what;
  same(separate.expert, fused.expert, size_t(slots_used) * 4, "slot experts");
  same(separate.offset, fused.offset, size_t(slots_used + 1) * 4, "slot offsets");
  same(separate.row_order, fused.row_order, size_t(pairs) * 4, "row order");
  if (shared) same(separate.pair_weights, fused.pair_weights, size_t(pairs) * 4, "pair weights");
}

// A router of the one-launch tests: E experts (32 with softmax scores, else sqrt(softplus); 384 with Pro's top-8),
// n tokens, hash routing or the selection-only bias.
RouterCase fused_router_case(int E, int n, bool hash) {
  RouterCase c;
  c.n = n, c.E = E, c.hash = hash, c.bias = !hash, c.scoring = E == 32 ? 2 : 0, c.k = E == 384 ? 8 : 6;
  return c;
}

TEST(CudaRouter, RouteAndSlotsInOneLaunch) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(34);
  int cases = 0;
  for (const int E : {32, 256, 384})
    for (const int n : {1, 5, 64})
      for (const bool hash : {false, true})
        for (const bool shared : {false, true}) {
          const RouterCase c = fused_router_case(E, n, hash);
          char what[96];
          std::snprintf(what, sizeof what, "E=%d n=%d hash=%d shared=%d", E, n, int(hash), int(shared));
          check_route_and_slots(make_router_inputs(c, rng, n == 5), shared, what);
          ++cases;
        }
  EXPECT_EQ(cases, 36);
  gpu::RouterParams r;
  r.n = 65;
  r.experts = 256;
  r.k = 6;
  MoeSlotsParams m;
  m.n = 65;
  m.k = 6;
  m.experts = 256;
  EXPECT_THROW(moe_route_and_slots(r, m), Error);  // more rows than a decode step
}

// The gate, router and slots in one launch (moe_gate_route_and_slots): linear_f32's logits and the two launches'
// outputs bit for bit, at the Flash gate's k = 4096 (one block per expert at E = 256, k split in cluster slices at
// E = 32) and a small k, for 1, 5 and 63 tokens (one and four rows per block).
TEST(CudaRouter, GateRouteAndSlotsInOneLaunch) {
  DSV4_REQUIRE_CUDA();
  std::mt19937 rng(35);
  int cases = 0;
  for (const int E : {32, 256, 384})
    for (const int n : {1, 5, 63})
      for (const bool hash : {false, true})
        for (const int k : {4096, 256}) {
          const RouterCase c = fused_router_case(E, n, hash);
          char what[96];
          std::snprintf(what, sizeof what, "gate E=%d n=%d hash=%d k=%d", E, n, int(hash), k);
          check_route_and_slots(make_router_inputs(c, rng, false), !hash, what, k);
          ++cases;
        }
  EXPECT_EQ(cases, 36);
  // Shapes it does not take: 64 tokens (linear_f32's tall kernel), 513 experts, k not a multiple of 4.
  DeviceBuffer x(64 * 4100 * 4), w(513 * 4100 * 4), y(64 * 513 * 4);
  EXPECT_FALSE(moe_gate_fits({x.as<float>(), w.as<float>(), y.as<float>(), 64, 256, 4096, 1.0f}));
  EXPECT_FALSE(moe_gate_fits({x.as<float>(), w.as<float>(), y.as<float>(), 8, 513, 4096, 1.0f}));
  EXPECT_FALSE(moe_gate_fits({x.as<float>(), w.as<float>(), y.as<float>(), 8, 256, 4098, 1.0f}));
  EXPECT_TRUE(moe_gate_fits({x.as<float>(), w.as<float>(), y.as<float>(), 63, 512, 4096, 1.0f}));
}

}  // namespace
}  // namespace dsv4
