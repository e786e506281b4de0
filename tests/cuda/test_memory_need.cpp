// SPDX-License-Identifier: MIT
// cuda_memory_need / check_cuda_memory: host arithmetic, so these run without a GPU (in CI too). The state per
// sequence must be exactly the CPU state's size (the CUDA state has its layout); the Flash-shaped model with all 256
// routed experts in NVFP4 must need more than one H200 holds (spec 9: 284B parameters, 277B of them in experts at
// 4.5 bits), and the check must say so before anything is uploaded; the bench's 32 experts must fit; a long context
// on many sequences must be refused for its state, with the advice to lower --max-context. The layer split over
// GPUs (cuda_pipeline_stages) must cover every layer once, balance the weight bytes, and make Flash fit two H200s or
// four H100s.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <vector>
#include <string>

#include "core/check.h"
#include "cuda/runner.h"
#include "model/model.h"
#include "model/state.h"
#include "model/synthetic.h"
#include "quant/inspect.h"

namespace dsv4 {
namespace {

constexpr size_t kGiB = size_t(1) << 30;

CudaRunnerOptions nvfp4_synthetic(int sequences = 1) {
  CudaRunnerOptions o;
  o.synthetic_format = GemvWeight::NVFP4;
  o.sequences = sequences;
  return o;
}

std::string refusal(const CudaMemoryNeed& need, size_t free_bytes, int max_context) {
  try {
    check_cuda_memory(need, free_bytes, 141 * kGiB, max_context);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaMemoryNeed, StateIsTheCpuStateSize) {
  for (const ModelConfig& c : {small_synthetic_config(), flash_shaped_config(8)}) {
    const Model model(c, synthetic_weights(c, 1), Numerics{});
    for (int ctx : {1, 100, 128, 4096, 10000})
      EXPECT_EQ(cuda_memory_need(model, ctx, nvfp4_synthetic()).state_per_sequence,
                SequenceState::create(c, ctx).bytes())
          << c.summary() << ", context " << ctx;
  }
}

TEST(CudaMemoryNeed, FlashWithAllExpertsDoesNotFitOneH200) {
  const ModelConfig c = flash_shaped_config(256);
  const Model model(c, synthetic_weights(c, 1), Numerics{});
  const CudaMemoryNeed need = cuda_memory_need(model, 8192, nvfp4_synthetic());
  // Routed experts alone: 43 layers x 256 x 3 x 2048 x 4096 weights at 4 bits + one e4m3 scale per 16.
  const double experts = 43.0 * 256 * 3 * 2048 * 4096 * (0.5 + 1.0 / 16);
  EXPECT_GT(double(need.weights), experts);
  EXPECT_LT(double(need.weights), experts + 8e9);  // + attention, shared experts, bf16 embedding and head, fp32
  const std::string message = refusal(need, 139 * kGiB, 8192);
  std::printf("[memory] %s\n", message.c_str());
  EXPECT_NE(message.find("weights alone do not fit"), std::string::npos) << message;
  EXPECT_NE(message.find("139.0 GiB free"), std::string::npos) << message;
}

TEST(CudaMemoryNeed, BenchModelFitsAndLongContextsAreRefusedForTheirState) {
  const ModelConfig c = flash_shaped_config(32);
  const Model model(c, synthetic_weights(c, 1), Numerics{});
  const CudaMemoryNeed bench = cuda_memory_need(model, 41000, nvfp4_synthetic(33));
  EXPECT_LT(bench.total(), 60 * kGiB);
  EXPECT_EQ(refusal(bench, 139 * kGiB, 41000), "");
  const int million = 1 << 20;
  const CudaMemoryNeed is_long = cuda_memory_need(model, million, nvfp4_synthetic(64));
  EXPECT_GT(is_long.state_per_sequence, 4 * kGiB);  // ~2^18 compressed entries x 512 floats in each CSA layer
  EXPECT_EQ(is_long.total(), is_long.weights + is_long.workspaces + 64 * is_long.state_per_sequence);
  const std::string message = refusal(is_long, 139 * kGiB, million);
  std::printf("[memory] %s\n", message.c_str());
  EXPECT_NE(message.find("Lower --max-context"), std::string::npos) << message;
  EXPECT_NE(message.find("x 64 for --max-context 1048576"), std::string::npos) << message;
}

// The workspaces scale with the prefill chunk: Flash's at 4096 tokens are 8x those at 512 (the logits rows aside),
// and a GPU with room for the weights and state but not the workspaces is told to lower --cuda-prefill-chunk.
TEST(CudaMemoryNeed, WorkspacesFollowThePrefillChunk) {
  const ModelConfig c = flash_shaped_config(32);
  const Model model(c, synthetic_weights(c, 1), Numerics{});
  CudaRunnerOptions o = nvfp4_synthetic();
  o.prefill_chunk = 512;
  const CudaMemoryNeed at512 = cuda_memory_need(model, 8192, o);
  EXPECT_EQ(at512.prefill_chunk, 512);
  o.prefill_chunk = 4096;
  const CudaMemoryNeed at4096 = cuda_memory_need(model, 8192, o);
  EXPECT_EQ(at4096.prefill_chunk, 4096);
  const size_t logits = size_t(kCudaMaxChunk) * size_t(c.vocab_size) * 4;
  EXPECT_EQ(at4096.workspaces - logits, 8 * (at512.workspaces - logits));
  // Per token: 7 pairs x 2048 x 10 bytes (gate, up, h) + 7 x 4096 x 4 (y_pairs) + 4 x 4096 x 4 (streams) + ...
  EXPECT_GT(double(at4096.workspaces), 4096.0 * (7 * 2048 * 10 + 7 * 4096 * 4 + 4 * 4096 * 4));
  EXPECT_LT(double(at4096.workspaces), 3.0 * kGiB);
  EXPECT_EQ(at4096.total(), at4096.weights + at4096.workspaces + at4096.state_per_sequence);
  const size_t room = at4096.weights + at4096.state_per_sequence + at4096.workspaces / 2;
  const std::string message = refusal(at4096, room, 8192);
  std::printf("[memory] %s\n", message.c_str());
  EXPECT_NE(message.find("Lower --cuda-prefill-chunk"), std::string::npos) << message;
  EXPECT_NE(message.find("prefill chunks of 4096 tokens"), std::string::npos) << message;
  EXPECT_EQ(refusal(at512, room, 8192), "");
}

// The stages' needs add up to the whole model's (the MTP block's embedding copy aside) and balance the weights: the
// Flash shape with all 256 routed experts fits two H200s (~139 GiB free each) or four H100s (~78 GiB).
TEST(CudaPipelineStages, SplitFlashOverTwoAndFourGpus) {
  const ModelConfig c = flash_shaped_config(256);
  const Model model(c, synthetic_weights(c, 1), Numerics{});
  const CudaRunnerOptions one = nvfp4_synthetic();
  const CudaMemoryNeed whole = cuda_memory_need(model, 8192, one);
  const std::vector<CudaStage> alone = cuda_pipeline_stages(model, one, 3);
  ASSERT_EQ(alone.size(), 1u);
  EXPECT_EQ(alone[0].device, 3);  // the current device
  EXPECT_EQ(alone[0].layer_end, c.n_layers);
  EXPECT_EQ(alone[0].weight_bytes, whole.weights);
  const size_t layer_bytes = cuda_memory_need(model, 8192, one, 5, 6).weights;  // a middle layer
  for (const std::vector<int>& devices : {std::vector<int>{0, 1}, std::vector<int>{0, 1, 2, 3}}) {
    CudaRunnerOptions o = nvfp4_synthetic();
    o.devices = devices;
    const std::vector<CudaStage> stages = cuda_pipeline_stages(model, o);
    ASSERT_EQ(stages.size(), devices.size());
    size_t weights = 0, state = 0, largest = 0;
    for (size_t i = 0; i < stages.size(); ++i) {
      const CudaStage& s = stages[i];
      EXPECT_EQ(s.device, devices[i]);
      EXPECT_EQ(s.layer_begin, i ? stages[i - 1].layer_end : 0);
      EXPECT_LT(s.layer_begin, s.layer_end);
      const CudaMemoryNeed need = cuda_memory_need(model, 8192, o, s.layer_begin, s.layer_end);
      EXPECT_EQ(need.weights, s.weight_bytes);
      weights += need.weights;
      state += need.state_per_sequence;
      largest = std::max(largest, need.weights);
      std::printf("[pipeline] %zu GPUs: GPU %d layers %d..%d, %.2f GiB of weights\n", stages.size(), s.device,
                  s.layer_begin, s.layer_end - 1, double(s.weight_bytes) / kGiB);
    }
    EXPECT_EQ(stages.back().layer_end, c.n_layers);
    EXPECT_EQ(weights, whole.weights);
    EXPECT_EQ(state, whole.state_per_sequence);
    // Balanced to within a layer (the embedding and head are about half a layer each).
    EXPECT_LE(double(largest), double(whole.weights) / double(stages.size()) + double(layer_bytes));
    EXPECT_LT(largest, (stages.size() == 2 ? 80 : 41) * kGiB);
  }
}

TEST(CudaPipelineStages, ChosenFirstLayersAndErrors) {
  const ModelConfig c = flash_shaped_config(8);
  const Model model(c, synthetic_weights(c, 1, SyntheticLinears::ShapeOnly, true), Numerics{});
  ASSERT_TRUE(model.has_mtp());
  CudaRunnerOptions o = nvfp4_synthetic();
  o.devices = {1, 0, 1};
  o.stage_first_layers = {10, 30};
  const std::vector<CudaStage> stages = cuda_pipeline_stages(model, o);
  ASSERT_EQ(stages.size(), 3u);
  EXPECT_EQ(stages[0].layer_end, 10);
  EXPECT_EQ(stages[1].layer_begin, 10);
  EXPECT_EQ(stages[2].layer_begin, 30);
  EXPECT_EQ(stages[2].layer_end, c.n_layers);
  // The last stage holds the MTP block and its own copy of the embedding: the stages need one table more than the
  // whole model on one GPU.
  size_t weights = 0;
  for (const CudaStage& s : stages) weights += s.weight_bytes;
  const size_t table = size_t(c.vocab_size) * size_t(c.hidden_size) * 2;
  EXPECT_EQ(weights, cuda_memory_need(model, 64, o).weights + table);
  auto message = [&](std::vector<int> devices, std::vector<int> first_layers) -> std::string {
    CudaRunnerOptions bad = nvfp4_synthetic();
    bad.devices = std::move(devices);
    bad.stage_first_layers = std::move(first_layers);
    try {
      cuda_pipeline_stages(model, bad);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message({0, 1}, {0}).find("must increase inside (0, 43)"), std::string::npos);
  EXPECT_NE(message({0, 1}, {43}).find("must increase"), std::string::npos);
  EXPECT_NE(message({0, 1, 2}, {20, 20}).find("must increase"), std::string::npos);
  EXPECT_NE(message({0, 1}, {5, 9}).find("2 stage first layers for 2 GPUs"), std::string::npos);
  EXPECT_NE(message({0, -1}, {}).find("not a device ordinal"), std::string::npos);
  EXPECT_NE(message(std::vector<int>(44, 0), {}).find("44 GPUs for a model of 43 layers"), std::string::npos);
  EXPECT_EQ(cuda_pipeline_stages(model, [&] {
              CudaRunnerOptions every = nvfp4_synthetic();
              every.devices = std::vector<int>(43, 0);
              return every;
            }()).size(), 43u);  // one layer each
  EXPECT_THROW(cuda_memory_need(model, 64, o, 5, 5), Error);
  EXPECT_THROW(cuda_memory_need(model, 64, o, 0, 44), Error);
}

// `dsv4 inspect` estimates the GPU weights from the checkpoint alone; on a checkpoint the runner would load they must
// be what cuda_memory_need counts (tid2eid goes up as int32, the size inspect gives an fp32).
TEST(CudaMemoryNeed, InspectEstimateIsTheRunnersNeed) {
  for (const char* name : {"tiny-flash", "tiny-pro"}) {
    const std::string dir = std::string(DSV4_TEST_DATA) + "/golden/" + name;
    const Model model = Model::load(dir, Numerics{}, WeightLoad::KeepLinearsPacked);
    const InspectReport report = inspect_checkpoint(dir);
    EXPECT_EQ(report.gpu_bytes, cuda_memory_need(model, 64, CudaRunnerOptions{}).weights) << name;
    EXPECT_EQ(report.cpu_fp32_bytes, uint64_t(report.params) * 4) << name;
  }
}

TEST(CudaPipelineStages, ParseGpuLists) {
  EXPECT_EQ(parse_cuda_devices("0,1"), (std::vector<int>{0, 1}));
  EXPECT_EQ(parse_cuda_devices("3"), (std::vector<int>{3}));
  EXPECT_EQ(parse_cuda_devices("2,0,2"), (std::vector<int>{2, 0, 2}));
  for (const char* bad : {"", ",", "0,", ",1", "0,,1", "a", "-1", "0 1", "1.5", "0,x"})
    EXPECT_THROW(parse_cuda_devices(bad), Error) << "'" << bad << "'";
}

}  // namespace
}  // namespace dsv4
