// SPDX-License-Identifier: MIT
// A runner whose layers are split over GPUs (CudaRunnerOptions::devices, docs/multi_gpu.md). Every stage runs the
// one-GPU kernels on its layers and only the streams cross between stages, so a split must change no bits: the
// logits and drawn ids of every operation that crosses stages (prefill chunks queued back to back, graph-replayed
// decode, a rolled-back verify step, batched decode after copy_sequence, device draws, reset, the MTP block) are
// compared bit for bit with the one-stage runner. On one GPU every stage sits on device 0 (the hand-off is a copy
// within the GPU, the rest of the code is the same); the two-GPU test needs a second device of the same kind.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/check.h"
#include "cuda/device.h"
#include "cuda/runner.h"
#include "cuda_test_util.h"
#include "model/model.h"

#include <cuda_runtime.h>

namespace dsv4 {
namespace {

namespace fs = std::filesystem;

const Numerics kDefault{};  // FP8 KV, FP4 indexer: the official roundings on both sides of every boundary

Model golden_model(const std::string& name, bool mtp = false) {
  return Model::load((fs::path(DSV4_TEST_DATA) / "golden" / name).string(), kDefault, WeightLoad::KeepLinearsPacked,
                     mtp);
}

constexpr int kSequences = 3;
constexpr int kContext = 256;

struct Trace {
  std::vector<float> logits;
  std::vector<int32_t> ids;
};

void append(std::vector<float>& to, const std::vector<float>& rows) { to.insert(to.end(), rows.begin(), rows.end()); }

// Everything the runner does that crosses stages, on sequence 0 (then 0 .. kSequences - 1 batched).
Trace exercise(SequenceRunner& r) {
  const int V = r.config().vocab_size;
  std::mt19937 rng(31);
  std::uniform_int_distribution<int32_t> token(2, V - 1);
  auto tokens = [&](int n) {
    std::vector<int32_t> t(static_cast<size_t>(n));
    for (int32_t& id : t) id = token(rng);
    return t;
  };
  Trace t;
  append(t.logits, r.forward(tokens(150), false));  // three chunks of 64: the first two without a synchronisation
  for (int step = 0; step < 6; ++step) append(t.logits, r.forward(tokens(1), true));  // graph replays
  const int64_t keep = r.n_tokens() + 2;
  append(t.logits, r.forward(tokens(4), false));  // a verify step, two of its rows forgotten
  r.rollback(keep);
  append(t.logits, r.forward(tokens(1), true));
  for (int b = 1; b < kSequences; ++b) cuda_runner_copy_sequence(r, 0, b);
  for (int step = 0; step < 4; ++step) append(t.logits, cuda_runner_decode_batch(r, tokens(kSequences)));
  cuda_runner_set_draw_on_device(r, true);
  TokenDraw draw{0.8f, 0.95f, 0, V, 0.25};
  for (int step = 0; step < 3; ++step) {
    draw.u = 0.1 + 0.3 * step;
    t.ids.push_back(r.forward_draw(tokens(1), draw));
    const std::vector<int32_t> batch =
        cuda_runner_decode_batch_draw(r, tokens(kSequences), std::vector<TokenDraw>(kSequences, draw));
    t.ids.insert(t.ids.end(), batch.begin(), batch.end());
  }
  cuda_runner_set_draw_on_device(r, false);
  r.reset();
  append(t.logits, r.forward(tokens(20), true));
  cuda_runner_select_sequence(r, 2);
  append(t.logits, r.forward(tokens(1), true));
  cuda_runner_select_sequence(r, 0);
  return t;
}

CudaRunnerOptions options_on(std::vector<int> devices, std::vector<int> first_layers) {
  CudaRunnerOptions o;
  o.sequences = kSequences;
  o.prefill_chunk = 64;
  o.devices = std::move(devices);
  o.stage_first_layers = std::move(first_layers);
  return o;
}

int current_device() {
  int d = 0;
  cudaGetDevice(&d);
  return d;
}

// The split runner against the one-stage runner: the same bits everywhere, and the same kernels in the decode graphs.
void expect_same_as_one_stage(const Model& model, const std::string& name, const Trace& one, int64_t one_kernels,
                              std::vector<int> devices, std::vector<int> first_layers) {
  std::string split = name + " split before layers";
  for (int l : first_layers) split += " " + std::to_string(l);
  split += " on GPUs";
  for (int d : devices) split += " " + std::to_string(d);
  const size_t stages = devices.size();
  std::unique_ptr<SequenceRunner> r =
      make_cuda_runner(model, kContext, options_on(std::move(devices), std::move(first_layers)));
  const Trace got = exercise(*r);
  const CudaRunnerStats stats = cuda_runner_stats(*r);
  EXPECT_EQ(stats.stages, int(stages)) << split;
  EXPECT_GT(stats.stage_copies, 0) << split;
  // fuse_mhc_post leaves a stage's last post to its own launch (the next hc_pre is on the next stage): one kernel
  // more per boundary where the cluster collapse would have applied it.
  const bool post_fused = CudaRunnerOptions{}.fuse_mhc_post && model.config().hidden_size % 64 == 0;
  EXPECT_EQ(stats.graph_kernels, one_kernels + (post_fused ? int64_t(stages) - 1 : 0))
      << split << ": the stages' decode graphs hold the one-stage kernels";
  ASSERT_EQ(got.logits.size(), one.logits.size()) << split;
  EXPECT_EQ(std::memcmp(got.logits.data(), one.logits.data(), one.logits.size() * sizeof(float)), 0) << split;
  EXPECT_EQ(got.ids, one.ids) << split;
  const std::vector<CudaStage> parts = cuda_runner_stages(*r);
  ASSERT_EQ(parts.size(), stages) << split;
  EXPECT_EQ(parts.front().layer_begin, 0) << split;
  EXPECT_EQ(parts.back().layer_end, model.config().n_layers) << split;
  for (size_t i = 1; i < parts.size(); ++i) EXPECT_EQ(parts[i].layer_begin, parts[i - 1].layer_end) << split;
}

TEST(CudaPipeline, SplitOnOneGpuChangesNoBits) {
  DSV4_REQUIRE_CUDA();
  const int d = current_device();
  for (const char* name : {"tiny-flash", "tiny-pro"}) {
    const Model model = golden_model(name);
    const int L = model.config().n_layers;
    ASSERT_GE(L, 3) << name;
    std::unique_ptr<SequenceRunner> one = make_cuda_runner(model, kContext, options_on({}, {}));
    const Trace reference = exercise(*one);
    const int64_t kernels = cuda_runner_stats(*one).graph_kernels;
    EXPECT_EQ(cuda_runner_stats(*one).stages, 1);
    EXPECT_EQ(cuda_runner_stats(*one).stage_copies, 0);
    for (int k = 1; k < L; ++k) expect_same_as_one_stage(model, name, reference, kernels, {d, d}, {k});
    expect_same_as_one_stage(model, name, reference, kernels, {d, d, d}, {1, L - 1});
    expect_same_as_one_stage(model, name, reference, kernels, {d, d}, {});  // split by weight bytes
  }
}

// The MTP block lives on the last stage, with the head and a copy of the embedding; the main model's final streams
// it reads are the last stage's.
TEST(CudaPipeline, MtpBlockOnTheLastStage) {
  DSV4_REQUIRE_CUDA();
  const int d = current_device();
  const Model model = golden_model("tiny-mtp", true);
  ASSERT_TRUE(model.has_mtp());
  const int V = model.config().vocab_size;
  auto run = [&](std::vector<int> devices, std::vector<int> first_layers) {
    std::unique_ptr<SequenceRunner> r =
        make_cuda_runner(model, kContext, options_on(std::move(devices), std::move(first_layers)));
    EXPECT_TRUE(r->has_mtp());
    std::vector<int32_t> ids(60);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 37 + 11) % size_t(V));
    Trace t;
    r->forward(std::span<const int32_t>(ids.data(), 40), true);
    t.ids.push_back(int32_t(r->mtp_pending()));
    append(t.logits, cuda_runner_mtp_logits(*r, std::span<const int32_t>(ids.data() + 1, 39)));
    for (size_t i = 40; i < ids.size(); ++i) {
      r->forward(std::span<const int32_t>(ids.data() + i, 1), true);
      t.ids.push_back(int32_t(r->mtp_pending()));
      t.ids.push_back(r->mtp_draft(std::span<const int32_t>(ids.data() + i, 1)));
    }
    return t;
  };
  const Trace one = run({}, {});
  for (int k = 1; k < model.config().n_layers; ++k) {
    const Trace split = run({d, d}, {k});
    ASSERT_EQ(split.logits.size(), one.logits.size()) << "split before layer " << k;
    EXPECT_EQ(std::memcmp(split.logits.data(), one.logits.data(), one.logits.size() * sizeof(float)), 0)
        << "split before layer " << k;
    EXPECT_EQ(split.ids, one.ids) << "split before layer " << k;
  }
}

// Two GPUs of the same kind run the same kernels with the same launch shapes: the same bits as one GPU.
TEST(CudaPipeline, TwoGpusChangeNoBits) {
  DSV4_REQUIRE_CUDA();
  int count = 0;
  cudaGetDeviceCount(&count);
  if (count < 2) GTEST_SKIP() << "one CUDA device";
  if (device_info(0).name != device_info(1).name || device_info(0).sm_count != device_info(1).sm_count)
    GTEST_SKIP() << "devices 0 and 1 differ (" << device_info(0).name << ", " << device_info(1).name << ")";
  cudaSetDevice(0);
  for (const char* name : {"tiny-flash", "tiny-pro"}) {
    const Model model = golden_model(name);
    std::unique_ptr<SequenceRunner> one = make_cuda_runner(model, kContext, options_on({0}, {}));
    const Trace reference = exercise(*one);
    const int64_t kernels = cuda_runner_stats(*one).graph_kernels;
    const int L = model.config().n_layers;
    expect_same_as_one_stage(model, name, reference, kernels, {0, 1}, {L / 2});
    expect_same_as_one_stage(model, name, reference, kernels, {1, 0}, {1});
  }
  int current = -1;
  cudaGetDevice(&current);
  EXPECT_EQ(current, 0) << "the runner restores the caller's device";
}

TEST(CudaPipeline, BadSplitsAreClearErrors) {
  DSV4_REQUIRE_CUDA();
  const Model model = golden_model("tiny-flash");
  int count = 0;
  cudaGetDeviceCount(&count);
  auto message = [&](std::vector<int> devices, std::vector<int> first_layers) -> std::string {
    try {
      make_cuda_runner(model, kContext, options_on(std::move(devices), std::move(first_layers)));
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message({0, count}, {}).find("does not exist"), std::string::npos);
  EXPECT_NE(message({0, 0}, {0}).find("must increase"), std::string::npos);
  EXPECT_NE(message({0, 0}, {1, 2}).find("2 stage first layers for 2 GPUs"), std::string::npos);
  // A profiled step times one GPU's launch sites.
  std::unique_ptr<SequenceRunner> r = make_cuda_runner(model, kContext, options_on({0, 0}, {1}));
  const std::vector<int32_t> one{5};
  EXPECT_THROW(cuda_runner_profile_step(*r, one), Error);
}

}  // namespace
}  // namespace dsv4
