// SPDX-License-Identifier: MIT
// `dsv4 inspect`: what a checkpoint holds, grouped by role (quant/tensor_groups.h) and storage format
// (quant/stored_weight.h): tensor counts, parameters, bytes on disk and bytes read per decoded token.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "quant/tensor_groups.h"

namespace dsv4 {

struct InspectRow {
  TensorGroup group;
  std::string format;         // "bf16", "f32", "fp8-block128 (e8m0 scales)", "mxfp4", "nvfp4", "i64", ...
  int64_t tensors = 0;        // weights, their scale tensors folded in
  int64_t params = 0;         // logical elements (a packed FP4 byte holds 2)
  uint64_t bytes = 0;         // on disk, scales included
  uint64_t bytes_per_token = 0;  // read per decoded token at batch 1 (see inspect_checkpoint)
};

struct InspectReport {
  std::string config_summary;
  std::string quantization_config;  // compact JSON, empty when absent
  std::vector<InspectRow> rows;     // ordered by group, then format
  int64_t params = 0;
  uint64_t bytes = 0, bytes_per_token = 0;
  // The weights' memory in each way of running the model (the MTP block left out; per-sequence state and workspaces
  // come on top): --device cpu --cpu-weights fp32 (every value fp32), --cpu-weights packed (linear layers as stored
  // and mapped from the files where their encoding has a packed form: BF16, FP8 blocks with e8m0 / f32 scales, MXFP4,
  // NVFP4; the rest fp32), --device cuda (the same linears as stored, other linears and the embedding as bf16, the
  // rest fp32: what cuda_memory_need counts).
  uint64_t cpu_fp32_bytes = 0, cpu_packed_bytes = 0, gpu_bytes = 0;
};

// Bytes per decoded token: one row of the embedding and of tid2eid, top_k / n_routed_experts of the routed experts
// (every expert is the same size, so this is exact at batch 1), nothing of MTP (unused), everything else in full.
InspectReport inspect_checkpoint(const std::string& model_dir);
std::string format_report(const InspectReport& report);

}  // namespace dsv4
