// SPDX-License-Identifier: MIT
// Weight quantisers (the exact inverses of quant/stored_weight's decoders up to rounding) and the streaming
// checkpoint converter behind `dsv4 quantize`.
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace dsv4 {

// ---- block quantisers: w is one row-major [rows, cols] fp32 matrix ----

// ModelOpt NVFP4 (formats/nvfp4.h). `global_amax` sets weight_scale_2 = global_amax / 2688; pass amax(w), or the
// larger amax of the linears that share this one's input (ModelOpt gives w1/w3 one weight_scale_2).
// cols must be a multiple of 16. packed: [rows, cols/2] codes; scale: [rows, cols/16] e4m3 bytes.
struct Nvfp4Matrix {
  std::vector<uint8_t> packed, scale;
  float global_scale = 0.0f;
};
Nvfp4Matrix quantize_nvfp4(std::span<const float> w, int64_t rows, int64_t cols, float global_amax);

// DeepSeek FP8 block: codes [rows, cols] e4m3; scale [ceil(rows/128), ceil(cols/128)] e8m0, the smallest power
// of two with tile_amax / scale <= 448.
struct Fp8BlockMatrix {
  std::vector<uint8_t> codes, scale;
};
Fp8BlockMatrix quantize_fp8_block(std::span<const float> w, int64_t rows, int64_t cols);

// DeepSeek FP4 experts: packed [rows, cols/2]; scale [rows, ceil(cols/32)] e8m0, the smallest power of two with
// group_amax / scale <= 6. cols must be even.
struct Mxfp4Matrix {
  std::vector<uint8_t> packed, scale;
};
Mxfp4Matrix quantize_mxfp4(std::span<const float> w, int64_t rows, int64_t cols);

float abs_max(std::span<const float> w);

// ---- checkpoint conversion ----

enum class QuantTarget {
  Nvfp4,     // ModelOpt NVFP4 routed experts (+ the big linears with all_linears); everything else as it is
  DeepSeek,  // the official release layout: FP8 128x128 e8m0 linears, FP4 (e8m0 per 32) routed experts
};
QuantTarget parse_quant_target(const std::string& name);  // "nvfp4", "deepseek"

struct QuantizeOptions {
  std::string model_dir, out_dir;
  QuantTarget target = QuantTarget::Nvfp4;
  bool all_linears = false;  // nvfp4: also wq_a, wq_b, wkv, wo_a, wo_b, indexer wq_b, shared experts
  // Called after each tensor: (tensors done, tensors total, bytes written so far).
  std::function<void(int64_t, int64_t, uint64_t)> progress;
};

struct QuantizeReport {
  int64_t tensors_in = 0, tensors_out = 0, quantized = 0, copied = 0, shards = 0;
  uint64_t bytes_in = 0, bytes_out = 0;
  std::vector<std::string> notes;  // things the user should know (kept-as-is tensors of a quantisable role)
};

// Reads model_dir one input shard at a time and writes out_dir: one output shard per input shard,
// model.safetensors.index.json, config.json with the format's quantization_config, hf_quant_config.json (nvfp4),
// and copies of the other top-level files (tokenizer etc.). Tensor names are kept. Routed experts (and, selected,
// the big linears) are quantised; router gate, norms, hc parameters, compressor / indexer projections, sinks,
// tid2eid, embeddings, head and MTP tensors are copied byte for byte. Quantised inputs are dequantised exactly
// first. Throws dsv4::Error naming the tensor or file on any problem.
QuantizeReport quantize_checkpoint(const QuantizeOptions& options);

}  // namespace dsv4
