// SPDX-License-Identifier: MIT
#include "model/config.h"

#include <spdlog/spdlog.h>

#include <fstream>

#include "core/check.h"

namespace dsv4 {
namespace {

using nlohmann::json;

bool has(const json& j, const char* key) { return j.contains(key) && !j.at(key).is_null(); }

int get_int(const json& j, const char* key) {
  DSV4_CHECK(has(j, key), "config.json: missing required field \"{}\"", key);
  const json& v = j.at(key);
  DSV4_CHECK(v.is_number_integer() || (v.is_number_float() && v.get<double>() == int64_t(v.get<double>())),
             "config.json: field \"{}\" must be an integer, got {}", key, v.dump());
  return v.get<int>();
}
int get_int(const json& j, const char* key, int fallback) { return has(j, key) ? get_int(j, key) : fallback; }

double get_num(const json& j, const char* key, double fallback) {
  if (!has(j, key)) return fallback;
  const json& v = j.at(key);
  DSV4_CHECK(v.is_number(), "config.json: field \"{}\" must be a number, got {}", key, v.dump());
  return v.get<double>();
}

bool get_bool(const json& j, const char* key, bool fallback) {
  if (!has(j, key)) return fallback;
  DSV4_CHECK(j.at(key).is_boolean(), "config.json: field \"{}\" must be true/false", key);
  return j.at(key).get<bool>();
}

// YaRN parameters from either an official `rope_scaling` block or a transformers `rope_parameters.compress`.
RopeConfig parse_rope(const json* params, double theta, double max_position) {
  RopeConfig r;
  r.theta = theta;
  if (!params) return r;
  std::string type = "default";
  if (has(*params, "rope_type")) type = params->at("rope_type").get<std::string>();
  else if (has(*params, "type")) type = params->at("type").get<std::string>();
  if (type == "default") return r;
  DSV4_CHECK(type == "yarn", "config.json: rope type \"{}\" is not supported (only default and yarn)", type);
  r.yarn = true;
  r.factor = get_num(*params, "factor", 1.0);
  r.original_max_position = get_num(*params, "original_max_position_embeddings", max_position);
  r.beta_fast = get_num(*params, "beta_fast", 32.0);
  r.beta_slow = get_num(*params, "beta_slow", 1.0);
  const double attention_factor = get_num(*params, "attention_factor", 1.0);
  if (attention_factor != 1.0)
    spdlog::warn("config.json: rope attention_factor {} ignored; DeepSeek-V4 applies no YaRN magnitude scaling",
                 attention_factor);
  return r;
}

AttnKind kind_from_layer_type(const std::string& t) {
  if (t == "sliding_attention") return AttnKind::Sliding;
  if (t == "compressed_sparse_attention") return AttnKind::CSA;
  if (t == "heavily_compressed_attention") return AttnKind::HCA;
  DSV4_FAIL("config.json: unknown layer_types entry \"{}\" (expected sliding_attention, "
            "compressed_sparse_attention or heavily_compressed_attention)", t);
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j) {
  DSV4_CHECK(j.is_object(), "config.json must be a JSON object");
  ModelConfig c;
  if (has(j, "model_type")) {
    const auto mt = j.at("model_type").get<std::string>();
    DSV4_CHECK(mt == "deepseek_v4", "config.json: model_type \"{}\" is not deepseek_v4", mt);
  }
  c.vocab_size = get_int(j, "vocab_size");
  c.hidden_size = get_int(j, "hidden_size");
  c.n_layers = get_int(j, "num_hidden_layers");
  c.n_heads = get_int(j, "num_attention_heads");
  const int n_kv_heads = get_int(j, "num_key_value_heads", 1);
  DSV4_CHECK(n_kv_heads == 1, "config.json: num_key_value_heads = {}; DeepSeek-V4 has one shared K=V head", n_kv_heads);
  c.head_dim = get_int(j, "head_dim");
  const json* rope_params = has(j, "rope_parameters") ? &j.at("rope_parameters") : nullptr;
  const json* rope_main_params = rope_params && rope_params->contains("main") ? &rope_params->at("main") : nullptr;
  const json* rope_compress_params =
      rope_params && rope_params->contains("compress") ? &rope_params->at("compress") : nullptr;
  if (has(j, "qk_rope_head_dim")) {
    c.rope_dim = get_int(j, "qk_rope_head_dim");
  } else {
    double factor = get_num(j, "partial_rotary_factor", 0.0);
    if (factor == 0.0 && rope_main_params) factor = get_num(*rope_main_params, "partial_rotary_factor", 0.0);
    DSV4_CHECK(factor > 0.0, "config.json: neither qk_rope_head_dim nor partial_rotary_factor is given");
    c.rope_dim = int(c.head_dim * factor + 0.5);
  }
  c.q_lora_rank = get_int(j, "q_lora_rank");
  c.o_groups = get_int(j, "o_groups");
  c.o_lora_rank = get_int(j, "o_lora_rank");
  c.window = get_int(j, "sliding_window");

  // Per-layer attention type: layer_types (+ compress_rates) or the legacy compress_ratios list.
  int rate_csa = 4, rate_hca = 128;
  if (has(j, "compress_rates")) {
    const json& rates = j.at("compress_rates");
    rate_csa = get_int(rates, "compressed_sparse_attention", rate_csa);
    rate_hca = get_int(rates, "heavily_compressed_attention", rate_hca);
  }
  rate_csa = get_int(j, "compress_rate_csa", rate_csa);
  rate_hca = get_int(j, "compress_rate_hca", rate_hca);
  if (has(j, "layer_types")) {
    const json& lt = j.at("layer_types");
    DSV4_CHECK(lt.is_array() && int(lt.size()) >= c.n_layers,
               "config.json: layer_types must list at least num_hidden_layers = {} entries", c.n_layers);
    for (int i = 0; i < c.n_layers; ++i) {
      const AttnKind kind = kind_from_layer_type(lt[i].get<std::string>());
      c.attn_kind.push_back(kind);
      c.compress_ratio.push_back(kind == AttnKind::CSA ? rate_csa : kind == AttnKind::HCA ? rate_hca : 0);
    }
  } else if (has(j, "compress_ratios")) {
    const json& cr = j.at("compress_ratios");
    // Official configs list one more entry (the MTP block, always 0) than there are main layers.
    DSV4_CHECK(cr.is_array() && int(cr.size()) >= c.n_layers,
               "config.json: compress_ratios must list at least num_hidden_layers = {} entries", c.n_layers);
    for (int i = 0; i < c.n_layers; ++i) {
      const int r = cr[i].get<int>();
      // The official reference overlaps (and indexes) exactly the ratio-4 layers.
      c.attn_kind.push_back(r == 0 ? AttnKind::Sliding : r == 4 ? AttnKind::CSA : AttnKind::HCA);
      c.compress_ratio.push_back(r);
    }
  } else {
    DSV4_FAIL("config.json: neither layer_types nor compress_ratios is given; cannot tell the attention type "
              "of each layer");
  }

  // Per-layer MoE routing: mlp_layer_types or num_hash_layers.
  if (has(j, "mlp_layer_types")) {
    const json& mt = j.at("mlp_layer_types");
    DSV4_CHECK(mt.is_array() && int(mt.size()) >= c.n_layers,
               "config.json: mlp_layer_types must list at least num_hidden_layers = {} entries", c.n_layers);
    for (int i = 0; i < c.n_layers; ++i) {
      const auto t = mt[i].get<std::string>();
      DSV4_CHECK(t == "hash_moe" || t == "moe", "config.json: unknown mlp_layer_types entry \"{}\"", t);
      c.hash_routed.push_back(t == "hash_moe");
    }
  } else {
    DSV4_CHECK(has(j, "num_hash_layers"), "config.json: neither mlp_layer_types nor num_hash_layers is given");
    const int n_hash = get_int(j, "num_hash_layers");
    for (int i = 0; i < c.n_layers; ++i) c.hash_routed.push_back(i < n_hash);
  }

  c.index_n_heads = get_int(j, "index_n_heads");
  c.index_head_dim = get_int(j, "index_head_dim");
  c.index_topk = get_int(j, "index_topk");
  c.n_routed_experts = get_int(j, "n_routed_experts");
  c.n_shared_experts = get_int(j, "n_shared_experts", 1);
  c.n_experts_per_tok = get_int(j, "num_experts_per_tok");
  c.moe_inter = get_int(j, "moe_intermediate_size");
  const std::string scoring = has(j, "scoring_func") ? j.at("scoring_func").get<std::string>() : "sqrtsoftplus";
  if (scoring == "sqrtsoftplus") c.scoring = ScoringFunc::SqrtSoftplus;
  else if (scoring == "sigmoid") c.scoring = ScoringFunc::Sigmoid;
  else if (scoring == "softmax") c.scoring = ScoringFunc::Softmax;
  else DSV4_FAIL("config.json: scoring_func \"{}\" is not supported (sqrtsoftplus, sigmoid, softmax)", scoring);
  c.norm_topk_prob = get_bool(j, "norm_topk_prob", true);
  c.routed_scaling_factor = float(get_num(j, "routed_scaling_factor", 1.0));
  c.swiglu_limit = float(get_num(j, "swiglu_limit", 0.0));
  c.hc_mult = get_int(j, "hc_mult");
  c.hc_sinkhorn_iters = get_int(j, "hc_sinkhorn_iters");
  c.hc_eps = float(get_num(j, "hc_eps", 1e-6));
  c.rms_norm_eps = float(get_num(j, "rms_norm_eps", 1e-6));

  const double max_position = get_num(j, "max_position_embeddings", 0.0);
  double theta_main = get_num(j, "rope_theta", 10000.0);
  if (rope_main_params) theta_main = get_num(*rope_main_params, "rope_theta", theta_main);
  double theta_compress = get_num(j, "compress_rope_theta", theta_main);
  if (rope_compress_params) theta_compress = get_num(*rope_compress_params, "rope_theta", theta_compress);
  c.rope_main = parse_rope(rope_main_params, theta_main, max_position);
  DSV4_CHECK(!c.rope_main.yarn, "config.json: YaRN on the sliding-window layers is not DeepSeek-V4 (spec 8.3.1)");
  const json* yarn_params = rope_compress_params ? rope_compress_params
                            : has(j, "rope_scaling") ? &j.at("rope_scaling")
                            : nullptr;
  c.rope_compress = parse_rope(yarn_params, theta_compress, max_position);

  c.bos_token_id = get_int(j, "bos_token_id", -1);
  if (has(j, "eos_token_id")) {
    const json& e = j.at("eos_token_id");
    if (e.is_array()) for (const auto& v : e) c.eos_token_ids.push_back(v.get<int>());
    else c.eos_token_ids.push_back(e.get<int>());
  }
  c.n_mtp_layers = get_int(j, "num_nextn_predict_layers", 0);
  if (has(j, "quantization_config")) c.quantization_config = j.at("quantization_config");
  c.validate();
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  DSV4_CHECK(in.good(), "cannot open {}", path);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    DSV4_FAIL("{} is not valid JSON: {}", path, e.what());
  }
  try {
    return from_json(j);
  } catch (const json::exception& e) {
    DSV4_FAIL("{}: a field has the wrong type: {}", path, e.what());
  }
}

ModelConfig ModelConfig::from_model_dir(const std::string& dir) { return from_file(dir + "/config.json"); }

void ModelConfig::validate() const {
  auto positive = [](int v, const char* name) {
    DSV4_CHECK(v > 0, "config.json: {} must be positive, got {}", name, v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(n_layers, "num_hidden_layers");
  positive(n_heads, "num_attention_heads");
  positive(head_dim, "head_dim");
  positive(q_lora_rank, "q_lora_rank");
  positive(o_groups, "o_groups");
  positive(o_lora_rank, "o_lora_rank");
  positive(window, "sliding_window");
  positive(n_routed_experts, "n_routed_experts");
  positive(n_experts_per_tok, "num_experts_per_tok");
  positive(moe_inter, "moe_intermediate_size");
  positive(hc_mult, "hc_mult");
  positive(hc_sinkhorn_iters, "hc_sinkhorn_iters");
  DSV4_CHECK(rope_dim > 0 && rope_dim % 2 == 0 && rope_dim <= head_dim,
             "config.json: rope dims {} must be even and at most head_dim {}", rope_dim, head_dim);
  DSV4_CHECK(n_heads % o_groups == 0, "config.json: num_attention_heads {} is not a multiple of o_groups {}",
             n_heads, o_groups);
  DSV4_CHECK(n_experts_per_tok <= n_routed_experts, "config.json: num_experts_per_tok {} > n_routed_experts {}",
             n_experts_per_tok, n_routed_experts);
  DSV4_CHECK(n_shared_experts >= 0 && n_shared_experts <= 1,
             "config.json: n_shared_experts = {} (the engine supports 0 or 1)", n_shared_experts);
  bool any_csa = false;
  for (int i = 0; i < n_layers; ++i) {
    if (attn_kind[i] != AttnKind::Sliding)
      DSV4_CHECK(compress_ratio[i] > 0, "config.json: layer {} has compression ratio {}", i, compress_ratio[i]);
    any_csa |= attn_kind[i] == AttnKind::CSA;
  }
  if (any_csa) {
    positive(index_n_heads, "index_n_heads");
    positive(index_topk, "index_topk");
    DSV4_CHECK(index_head_dim >= rope_dim, "config.json: index_head_dim {} < rope dims {}", index_head_dim, rope_dim);
  }
}

std::string ModelConfig::summary() const {
  int n_sliding = 0, n_csa = 0, n_hca = 0, n_hash = 0;
  for (int i = 0; i < n_layers; ++i) {
    n_sliding += attn_kind[i] == AttnKind::Sliding;
    n_csa += attn_kind[i] == AttnKind::CSA;
    n_hca += attn_kind[i] == AttnKind::HCA;
    n_hash += hash_routed[i];
  }
  return fmt::format(
      "layers {} (sliding {}, CSA {}, HCA {}; hash-routed {}), hidden {}, heads {} x {} (rope {}), q_lora {}, "
      "o_groups {} x {}, window {}, indexer {} x {} top-{}, experts {} top-{} + {} shared (inter {}), "
      "hc {} x sinkhorn {}, vocab {}, rope theta {} / compress {}{}",
      n_layers, n_sliding, n_csa, n_hca, n_hash, hidden_size, n_heads, head_dim, rope_dim, q_lora_rank, o_groups,
      o_lora_rank, window, index_n_heads, index_head_dim, index_topk, n_routed_experts, n_experts_per_tok,
      n_shared_experts, moe_inter, hc_mult, hc_sinkhorn_iters, vocab_size, rope_main.theta, rope_compress.theta,
      rope_compress.yarn ? fmt::format(" yarn x{}", rope_compress.factor) : "");
}

}  // namespace dsv4
