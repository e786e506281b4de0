// SPDX-License-Identifier: MIT
// Test helpers: a seeded tiny DeepSeek-V4 checkpoint (fp32, saved names as transformers writes them), and the
// fp32 checkpoint holding the exact dequantised weights of a quantised one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4::testing {

// Writes config.json + model.safetensors of a 4-layer model (sliding, CSA, HCA, CSA; layers 0-1 hash-routed;
// D 64, 8 experts of inter 32) with reproducible random weights (own PRNG, identical on every platform).
void write_tiny_checkpoint(const std::string& dir, uint64_t seed);

// Decodes every weight of `quantised_dir` with the engine's loader path (quant/stored_weight) and writes them
// as F32 under the same names (integer tensors copied) to `out_dir`, with config.json minus quantization_config.
void write_dequantised_checkpoint(const std::string& quantised_dir, const std::string& out_dir);

// Fixed prompt used by the quantisation end-to-end tests (and reference/quant/transformers_logits.py).
std::vector<int32_t> quant_test_prompt();

}  // namespace dsv4::testing
