// SPDX-License-Identifier: MIT
#include "tiny_checkpoint.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"
#include "io/safetensors.h"
#include "quant/stored_weight.h"

namespace dsv4::testing {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

constexpr int V = 256, D = 64, L = 4, H = 4, HD = 128, QL = 32, OG = 2, OL = 32, IH = 4, IHD = 128, E = 8, K = 2,
              I = 32, HC = 4;
const char* const kLayerTypes[L] = {"sliding_attention", "compressed_sparse_attention",
                                    "heavily_compressed_attention", "compressed_sparse_attention"};
constexpr int kHashLayers = 2;

// splitmix64 + Box-Muller: the same numbers with every compiler and standard library.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return double((next() >> 11) + 1) * (1.0 / 9007199254740993.0); }  // (0, 1)
  float normal() { return float(std::sqrt(-2.0 * std::log(uniform())) * std::cos(6.283185307179586 * uniform())); }
};

struct Owned {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

json tiny_config() {
  json rope_main = {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}};
  json rope_compress = {{"rope_type", "yarn"},        {"rope_theta", 160000.0},
                        {"factor", 16.0},             {"beta_fast", 32.0},
                        {"beta_slow", 1.0},           {"original_max_position_embeddings", 4096},
                        {"attention_factor", 1.0},    {"partial_rotary_factor", 0.5}};
  json layer_types = json::array(), mlp_types = json::array();
  for (int l = 0; l < L; ++l) {
    layer_types.push_back(kLayerTypes[l]);
    mlp_types.push_back(l < kHashLayers ? "hash_moe" : "moe");
  }
  return {{"architectures", {"DeepseekV4ForCausalLM"}},
          {"model_type", "deepseek_v4"},
          {"torch_dtype", "float32"},
          {"vocab_size", V},
          {"hidden_size", D},
          {"num_hidden_layers", L},
          {"num_attention_heads", H},
          {"num_key_value_heads", 1},
          {"head_dim", HD},
          {"partial_rotary_factor", 0.5},
          {"q_lora_rank", QL},
          {"o_groups", OG},
          {"o_lora_rank", OL},
          {"sliding_window", 128},
          {"layer_types", layer_types},
          {"compress_rates", {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 128}}},
          {"index_n_heads", IH},
          {"index_head_dim", IHD},
          {"index_topk", 8},
          {"n_routed_experts", E},
          {"n_shared_experts", 1},
          {"num_experts_per_tok", K},
          {"moe_intermediate_size", I},
          {"mlp_layer_types", mlp_types},
          {"scoring_func", "sqrtsoftplus"},
          {"norm_topk_prob", true},
          {"routed_scaling_factor", 1.5},
          {"swiglu_limit", 2.0},
          {"hc_mult", HC},
          {"hc_sinkhorn_iters", 20},
          {"hc_eps", 1e-6},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},
          {"compress_rope_theta", 160000.0},
          {"rope_parameters", {{"main", rope_main}, {"compress", rope_compress}}},
          {"max_position_embeddings", 65536},
          {"tie_word_embeddings", false},
          {"bos_token_id", 0},
          {"eos_token_id", 1},
          {"hidden_act", "silu"},
          {"attention_bias", false},
          {"num_nextn_predict_layers", 0}};
}

void write_json(const fs::path& p, const json& j) {
  std::ofstream out(p);
  out << j.dump(2) << "\n";
  DSV4_CHECK(out.good(), "cannot write {}", p.string());
}

void write_all(const fs::path& file, const std::vector<Owned>& tensors) {
  std::vector<TensorToWrite> views;
  for (const Owned& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.bytes});
  write_safetensors(file.string(), views, {{"format", "pt"}});
}

}  // namespace

void write_tiny_checkpoint(const std::string& dir, uint64_t seed) {
  fs::create_directories(dir);
  Rng rng{seed};
  std::vector<Owned> out;
  // mean + std * N(0, 1), fp32.
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float stdev, float mean = 0.0f) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = mean + stdev * rng.normal();
    Owned t{name, DType::F32, std::move(shape), std::vector<uint8_t>(v.size() * 4)};
    std::memcpy(t.bytes.data(), v.data(), t.bytes.size());
    out.push_back(std::move(t));
  };
  auto linear = [&](const std::string& name, int rows, int cols, float gain = 1.0f) {
    add(name, {rows, cols}, gain / std::sqrt(float(cols)));
  };
  add("model.embed_tokens.weight", {V, D}, 1.0f);
  linear("head.weight", V, D, 4.0f);
  add("model.norm.weight", {D}, 0.1f, 1.0f);
  add("model.hc_head.hc_fn", {HC, HC * D}, 0.05f);
  add("model.hc_head.hc_base", {HC}, 0.1f);
  add("model.hc_head.hc_scale", {1}, 0.1f, 0.5f);
  const int n_mix = (2 + HC) * HC;
  for (int l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "attn_norm.weight", {D}, 0.1f, 1.0f);
    add(p + "ffn_norm.weight", {D}, 0.1f, 1.0f);
    for (const char* site : {"hc_attn_", "hc_ffn_"}) {
      add(p + site + "fn", {n_mix, HC * D}, 0.05f);
      add(p + site + "base", {n_mix}, 0.1f);
      add(p + site + "scale", {3}, 0.1f, 0.5f);
    }
    linear(p + "attn.wq_a.weight", QL, D);
    add(p + "attn.q_norm.weight", {QL}, 0.1f, 1.0f);
    linear(p + "attn.wq_b.weight", H * HD, QL);
    linear(p + "attn.wkv.weight", HD, D);
    add(p + "attn.norm.weight", {HD}, 0.1f, 1.0f);
    linear(p + "attn.wo_a.weight", OG * OL, H * HD / OG);
    linear(p + "attn.wo_b.weight", D, OG * OL);
    add(p + "attn.attn_sink", {H}, 1.0f);
    const std::string kind = kLayerTypes[l];
    if (kind != "sliding_attention") {
      const bool csa = kind == "compressed_sparse_attention";
      const int ratio = csa ? 4 : 128, width = (csa ? 2 : 1) * HD;
      linear(p + "attn.compressor.wkv.weight", width, D);
      linear(p + "attn.compressor.wgate.weight", width, D);
      add(p + "attn.compressor.ape", {ratio, width}, 0.1f);
      add(p + "attn.compressor.norm.weight", {HD}, 0.1f, 1.0f);
      if (csa) {
        linear(p + "attn.indexer.wq_b.weight", IH * IHD, QL);
        linear(p + "attn.indexer.weights_proj.weight", IH, D);
        linear(p + "attn.indexer.compressor.wkv.weight", 2 * IHD, D);
        linear(p + "attn.indexer.compressor.wgate.weight", 2 * IHD, D);
        add(p + "attn.indexer.compressor.ape", {4, 2 * IHD}, 0.1f);
        add(p + "attn.indexer.compressor.norm.weight", {IHD}, 0.1f, 1.0f);
      }
    }
    linear(p + "ffn.gate.weight", E, D);
    if (l < kHashLayers) {
      std::vector<int64_t> ids;
      for (int v = 0; v < V; ++v) {
        const int64_t a = int64_t(rng.next() % E), b = (a + 1 + int64_t(rng.next() % (E - 1))) % E;  // distinct
        ids.push_back(a);
        ids.push_back(b);
      }
      Owned t{p + "ffn.gate.tid2eid", DType::I64, {V, K}, std::vector<uint8_t>(ids.size() * 8)};
      std::memcpy(t.bytes.data(), ids.data(), t.bytes.size());
      out.push_back(std::move(t));
    } else {
      add(p + "ffn.gate.bias", {E}, 0.1f);
    }
    for (int e = 0; e < E; ++e) {
      const std::string q = p + "ffn.experts." + std::to_string(e) + ".";
      linear(q + "w1.weight", I, D);
      linear(q + "w3.weight", I, D);
      linear(q + "w2.weight", D, I);
    }
    linear(p + "ffn.shared_experts.w1.weight", I, D, 0.8f);
    linear(p + "ffn.shared_experts.w3.weight", I, D, 0.8f);
    linear(p + "ffn.shared_experts.w2.weight", D, I, 0.8f);
  }
  write_all(fs::path(dir) / "model.safetensors", out);
  write_json(fs::path(dir) / "config.json", tiny_config());
}

void write_dequantised_checkpoint(const std::string& quantised_dir, const std::string& out_dir) {
  fs::create_directories(out_dir);
  const Checkpoint ckpt = Checkpoint::open(quantised_dir);
  // Quantised weights first (their scale tensors are F8/F32 too and must not be mistaken for weights).
  std::set<std::string> companions;
  std::vector<StoredWeight> weights;
  for (const auto& [name, t] : ckpt.tensors()) {
    StoredWeight w;
    w.weight = t;
    w.logical_shape = t->shape;
    if (t->dtype == DType::F8_E4M3 || t->dtype == DType::I8 || t->dtype == DType::U8) {
      try {
        w = classify_weight(ckpt, *t);
      } catch (const Error&) {
        continue;  // a scale tensor: decided below
      }
    }
    for (const TensorView* c : {w.scale, w.scale_2, w.input_scale})
      if (c) companions.insert(c->name);
    weights.push_back(w);
  }
  for (const auto& [name, t] : ckpt.tensors()) {
    const bool listed = std::any_of(weights.begin(), weights.end(), [&](const StoredWeight& w) { return w.weight == t; });
    DSV4_CHECK(listed || companions.count(name), "tensor \"{}\": neither a weight nor a known scale", name);
  }
  std::vector<Owned> out;
  for (const StoredWeight& w : weights) {
    const TensorView& t = *w.weight;
    if (companions.count(t.name)) continue;
    if (t.dtype == DType::I64 || t.dtype == DType::I32) {
      out.push_back({t.name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes)});
      continue;
    }
    const std::vector<float> v = dequantize(w, w.logical_shape);
    Owned o{t.name, DType::F32, w.logical_shape, std::vector<uint8_t>(v.size() * 4)};
    std::memcpy(o.bytes.data(), v.data(), o.bytes.size());
    out.push_back(std::move(o));
  }
  write_all(fs::path(out_dir) / "model.safetensors", out);
  std::ifstream in(fs::path(quantised_dir) / "config.json");
  json config = json::parse(in);
  config.erase("quantization_config");
  config.erase("expert_dtype");
  write_json(fs::path(out_dir) / "config.json", config);
}

std::vector<int32_t> quant_test_prompt() { return {0, 17, 42, 99, 3, 200, 7, 7, 128, 255, 64, 5}; }

}  // namespace dsv4::testing
