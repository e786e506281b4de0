// SPDX-License-Identifier: MIT
// DeepSeek-V4 hyper-parameters, read from a HF config.json. Every field the forward pass uses lives here, so
// nothing about Flash or Pro is baked into the engine. Both spellings real checkpoints ship are accepted: the
// transformers keys (layer_types + compress_rates, mlp_layer_types, partial_rotary_factor, rope_parameters
// {main, compress}) and the legacy/official keys (compress_ratios, compress_rate_csa/hca, num_hash_layers,
// qk_rope_head_dim, rope_scaling).
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace dsv4 {

struct RopeConfig {
  double theta = 10000.0;
  bool yarn = false;                  // YaRN frequency interpolation (no attention-magnitude factor: spec 3.1)
  double factor = 1.0;
  double original_max_position = 0.0;
  double beta_fast = 32.0, beta_slow = 1.0;
};

enum class ScoringFunc { SqrtSoftplus, Sigmoid, Softmax };

// Attention type of a layer (spec 1.2). CSA = overlapped compressor (width 2r, stride r) + lightning indexer;
// HCA = plain compressor, every compressed entry attended. All three also attend the sliding window.
enum class AttnKind { Sliding, CSA, HCA };

struct ModelConfig {
  int vocab_size = 0;
  int hidden_size = 0;                // D
  int n_layers = 0;
  int n_heads = 0;                    // H query heads; one shared K=V head
  int head_dim = 0;                   // 512 in V4
  int rope_dim = 0;                   // last rope_dim dims of each head are rotated (64)
  int q_lora_rank = 0;
  int o_groups = 0, o_lora_rank = 0;
  int window = 0;                     // sliding window (128)
  std::vector<AttnKind> attn_kind;    // per layer
  std::vector<int> compress_ratio;    // per layer: 0 for Sliding, r for CSA (4) / HCA (128)
  std::vector<bool> hash_routed;      // per layer: tid2eid routing
  int index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  int n_routed_experts = 0, n_shared_experts = 0, n_experts_per_tok = 0, moe_inter = 0;
  ScoringFunc scoring = ScoringFunc::SqrtSoftplus;
  bool norm_topk_prob = true;
  float routed_scaling_factor = 1.0f;
  float swiglu_limit = 0.0f;          // 0 = no clamp
  int hc_mult = 0, hc_sinkhorn_iters = 0;
  float hc_eps = 1e-6f, rms_norm_eps = 1e-6f;
  RopeConfig rope_main;               // sliding-only layers
  RopeConfig rope_compress;           // every tensor of CSA/HCA layers (q, window kv, compressed kv, indexer)
  int bos_token_id = -1;
  std::vector<int> eos_token_ids;
  int n_mtp_layers = 0;
  nlohmann::json quantization_config;  // null when absent

  static ModelConfig from_json(const nlohmann::json& j);
  static ModelConfig from_file(const std::string& config_json_path);
  static ModelConfig from_model_dir(const std::string& model_dir);  // <dir>/config.json

  // Rejects values the engine cannot run, naming the field.
  void validate() const;

  int nope_dim() const { return head_dim - rope_dim; }
  // Layer n_layers is the MTP block (spec 5): sliding-window attention, gated (not hash-routed) MoE.
  bool is_csa(int layer) const { return layer < n_layers && attn_kind[layer] == AttnKind::CSA; }
  bool has_compressor(int layer) const { return layer < n_layers && attn_kind[layer] != AttnKind::Sliding; }
  int ratio(int layer) const { return layer < n_layers ? compress_ratio[layer] : 0; }
  bool hashed(int layer) const { return layer < n_layers && hash_routed[layer]; }
  const RopeConfig& rope_for_layer(int layer) const {
    return has_compressor(layer) ? rope_compress : rope_main;
  }
  std::string summary() const;  // one line per group of fields, for logs and `dsv4 inspect`
};

}  // namespace dsv4
