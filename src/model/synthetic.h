// SPDX-License-Identifier: MIT
// Random models with real shapes, for benchmarks (`dsv4 bench`) and tests: no checkpoint needed.
//   flash_shaped_config   every DeepSeek-V4-Flash hyper-parameter of spec 1.1 / 1.2, with a chosen number of
//                         routed experts per layer (batch-1 decode reads 6 of them whatever the count, so fewer
//                         experts fit one GPU without changing the bytes per token, except the router gate's E rows)
//   synthetic_weights     linear-layer weights as shapes only (rows/cols, empty data: the CUDA runner creates them
//                         on the device, CudaRunnerOptions::synthetic_format); the small fp32 tensors the runner
//                         uploads from the host (norms, mHC, router gate and bias, tid2eid, ape, sinks, indexer
//                         weights_proj) get deterministic random values scaled so activations stay O(1).
#pragma once
#include <cstdint>

#include "model/config.h"
#include "model/weights.h"

namespace dsv4 {

// V4-Flash (43 layers, [0,0] + [4,128]x20 + [4], hash routing in layers 0..2) with n_routed_experts experts.
// No MTP block (the engine does not run it). Throws dsv4::Error when n_routed_experts < num_experts_per_tok (6).
ModelConfig flash_shaped_config(int n_routed_experts);

// The same structure at toy size (hidden 64, heads 4 x 128, 5 layers: sliding, sliding, CSA, HCA, CSA; hash routing in layers
// 0..2), for tests of the synthetic model itself.
ModelConfig small_synthetic_config();

enum class SyntheticLinears {
  ShapeOnly,  // rows/cols set, data empty (device-side synthesis)
  Filled,     // U(-1/sqrt(cols), 1/sqrt(cols)) host data too, so the CPU reference can run a small model
};

// Deterministic for a given (config, seed, linears); `mtp` adds an MTP block (spec 5) after the model's weights,
// which stay the same bits.
ModelWeights synthetic_weights(const ModelConfig& config, uint64_t seed,
                               SyntheticLinears linears = SyntheticLinears::ShapeOnly, bool mtp = false);

}  // namespace dsv4
