// SPDX-License-Identifier: MIT
// cuda_memory_need / check_cuda_memory: host arithmetic, so these run without a GPU (in CI too). The state per
// sequence must be exactly the CPU state's size (the CUDA state has its layout); the Flash-shaped model with all 256
// routed experts in NVFP4 must need more than one H200 holds (spec 9: 284B parameters, 277B of them in experts at
// 4.5 bits), and the check must say so before anything is uploaded; the bench's 32 experts must fit; a long context
// on many sequences must be refused for its state, with the advice to lower --max-context.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/check.h"
#include "cuda/runner.h"
#include "model/model.h"
#include "model/state.h"
#include "model/synthetic.h"

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
  EXPECT_EQ(is_long.total(), is_long.weights + 64 * is_long.state_per_sequence);
  const std::string message = refusal(is_long, 139 * kGiB, million);
  std::printf("[memory] %s\n", message.c_str());
  EXPECT_NE(message.find("Lower --max-context"), std::string::npos) << message;
  EXPECT_NE(message.find("x 64 for --max-context 1048576"), std::string::npos) << message;
}

}  // namespace
}  // namespace dsv4
