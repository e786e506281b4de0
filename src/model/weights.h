// SPDX-License-Identifier: MIT
// The model's parameters, one field per checkpoint tensor: fp32 arrays, or the linear layers packed in their encoding.
// Field names follow the official DeepSeek-V4 tensor names (spec 7.1); shapes are [rows, cols] row-major.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "model/config.h"
#include "quant/stored_weight.h"

namespace dsv4 {

class Checkpoint;

// A weight matrix: fp32 values (data), or for linear layers loaded with WeightLoad::KeepLinearsPacked its
// checkpoint encoding (packed, data empty), or neither (shape only: synthetic benchmark models, GPU only).
struct Matrix {
  int rows = 0, cols = 0;
  std::vector<float> data;
  std::optional<PackedWeight> packed;
  const float* row(int r) const { return data.data() + int64_t(r) * cols; }
  bool has_values() const { return !data.empty(); }
};
using Vector = std::vector<float>;

struct HyperConnWeights {
  Matrix fn;       // [(2+hc)*hc, hc*D] (block sites) or [hc, hc*D] (head)
  Vector base;     // [(2+hc)*hc] or [hc]
  Vector scale;    // [3] or [1]
};

struct CompressorWeights {
  int ratio = 0;
  bool overlap = false;  // CSA: two series of width dim (c = 2)
  int dim = 0;           // d_c: head_dim (main) or index_head_dim (indexer)
  Matrix wkv, wgate;     // [c*d_c, D]
  Matrix ape;            // [ratio, c*d_c]
  Vector norm;           // [d_c]
};

struct IndexerWeights {
  Matrix wq_b;             // [index_n_heads*index_head_dim, q_lora]
  Matrix weights_proj;     // [index_n_heads, D]
  CompressorWeights compressor;
};

struct AttentionWeights {
  Matrix wq_a;             // [q_lora, D]
  Vector q_norm;           // [q_lora]
  Matrix wq_b;             // [H*head_dim, q_lora]
  Matrix wkv;              // [head_dim, D]
  Vector kv_norm;          // [head_dim]
  Matrix wo_a;             // [o_groups*o_lora, H*head_dim/o_groups]
  Matrix wo_b;             // [D, o_groups*o_lora]
  Vector sink;             // [H]
  std::optional<CompressorWeights> compressor;  // CSA / HCA
  std::optional<IndexerWeights> indexer;        // CSA
};

struct ExpertWeights {
  Matrix w1, w3;  // [inter, D] gate, up
  Matrix w2;      // [D, inter] down
};

struct MoEWeights {
  Matrix gate;                   // [E, D]
  Vector gate_bias;              // [E] selection-only bias (gated layers)
  std::vector<int32_t> tid2eid;  // [vocab, top_k] (hash layers)
  std::vector<ExpertWeights> experts;
  std::optional<ExpertWeights> shared;
};

struct LayerWeights {
  Vector attn_norm, ffn_norm;    // [D]
  HyperConnWeights hc_attn, hc_ffn;
  AttentionWeights attn;
  MoEWeights ffn;
};

// The multi-token-prediction block (spec 5, "mtp.0."): a block like the others (sliding-window attention, gated
// MoE) fed with the main model's final streams and the next token's embedding; it guesses the token after that.
struct MtpWeights {
  LayerWeights block;
  Matrix e_proj, h_proj;         // [D, D]
  Vector enorm, hnorm, norm;     // [D]
  HyperConnWeights hc_head;      // [hc, hc*D] its own final collapse
};

struct ModelWeights {
  std::shared_ptr<const Checkpoint> storage;  // set when packed views point into it
  Matrix embed;                  // [vocab, D]
  Matrix head;                   // [vocab, D]
  Vector norm;                   // [D]
  HyperConnWeights hc_head;
  std::vector<LayerWeights> layers;
  std::optional<MtpWeights> mtp;  // loaded on request (load_weights' mtp)
};

// Loads and checks every tensor the config implies (official names, with or without a `model.` prefix, or the
// transformers names). Missing tensors, wrong shapes and unsupported dtypes throw dsv4::Error naming the tensor;
// tensors the engine does not use are listed in one warning (MTP weights in one info line).
// KeepLinearsPacked (the CUDA backend, and the CPU's --cpu-weights packed): the linear layers' weights (embedding
// excluded) stay in their checkpoint encoding as Matrix::packed views into the mapped files when the encoding has a
// packed form (every value is still checked);
// the rest, and encodings without a packed form (logged), are decoded to fp32 as with DecodeAll.
enum class WeightLoad { DecodeAll, KeepLinearsPacked };

// The matrices of the linear layers in a fixed order: the embedding and the head first, then each block's (attention,
// compressors, indexer, routed and shared experts), the MTP block's (and its e_proj, h_proj) last when loaded.
std::vector<Matrix*> linear_matrices(ModelWeights& w);
std::vector<const Matrix*> linear_matrices(const ModelWeights& w);
// mtp: also the MTP block (throws when the checkpoint has none).
ModelWeights load_weights(const ModelConfig& config, std::shared_ptr<const Checkpoint> checkpoint,
                          WeightLoad mode = WeightLoad::DecodeAll, bool mtp = false);

}  // namespace dsv4
