// SPDX-License-Identifier: MIT
#include "model/synthetic.h"

#include <cmath>
#include <numeric>
#include <random>

#include "core/check.h"

namespace dsv4 {
namespace {

// Fields shared by both configs that spec 1.1 fixes for every V4 model (Flash values where Flash and Pro differ).
void set_v4_constants(ModelConfig& c) {
  c.n_shared_experts = 1;
  c.n_experts_per_tok = 6;
  c.scoring = ScoringFunc::SqrtSoftplus;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 1.5f;
  c.swiglu_limit = 10.0f;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.rms_norm_eps = 1e-6f;
  c.rope_main = RopeConfig{};
  c.rope_main.theta = 10000.0;
  c.rope_compress = RopeConfig{};  // spec 1.1: compress_rope_theta 160000, YaRN x16 from 65536, beta 32 / 1
  c.rope_compress.theta = 160000.0;
  c.rope_compress.yarn = true;
  c.rope_compress.factor = 16.0;
  c.rope_compress.original_max_position = 65536.0;
  c.rope_compress.beta_fast = 32.0;
  c.rope_compress.beta_slow = 1.0;
  c.bos_token_id = 0;
  c.eos_token_ids = {1};
  c.n_mtp_layers = 0;  // no MTP weights are built
}

void set_layers(ModelConfig& c, const std::vector<int>& ratios, int csa_ratio, int n_hash_layers) {
  c.n_layers = int(ratios.size());
  c.attn_kind.clear(), c.compress_ratio.clear(), c.hash_routed.clear();
  for (int l = 0; l < c.n_layers; ++l) {
    const int r = ratios[l];
    c.attn_kind.push_back(r == 0 ? AttnKind::Sliding : r == csa_ratio ? AttnKind::CSA : AttnKind::HCA);
    c.compress_ratio.push_back(r);
    c.hash_routed.push_back(l < n_hash_layers);
  }
}

class Filler {
 public:
  Filler(uint64_t seed, SyntheticLinears linears) : rng_(seed), linears_(linears) {}

  Vector uniform(size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    Vector v(n);
    for (float& x : v) x = dist(rng_);
    return v;
  }
  Vector around_one(size_t n) { return uniform(n, 0.9f, 1.1f); }   // RMSNorm weights
  Vector small(size_t n, float a) { return uniform(n, -a, a); }

  static Matrix shape_only(int rows, int cols) {
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    return m;
  }
  Matrix uniform_matrix(int rows, int cols, float a) {
    Matrix m = shape_only(rows, cols);
    m.data = uniform(size_t(rows) * cols, -a, a);
    return m;
  }
  // A small fp32 matrix the runner uploads from the host: always has data, ~U(+-1/sqrt(cols)).
  Matrix dense(int rows, int cols) { return uniform_matrix(rows, cols, 1.0f / std::sqrt(float(cols))); }
  // A linear-layer weight: shape only unless the CPU reference needs the values.
  Matrix linear(int rows, int cols) {
    return linears_ == SyntheticLinears::Filled ? dense(rows, cols) : shape_only(rows, cols);
  }

  HyperConnWeights hyper_conn(int n_mix, int n_scale, int width) {
    HyperConnWeights w;
    w.fn = dense(n_mix, width);
    w.base = small(n_mix, 0.1f);
    w.scale = uniform(n_scale, 0.05f, 0.2f);  // positive: the mixes respond to the streams
    return w;
  }

  CompressorWeights compressor(int ratio, bool overlap, int dim, int D) {
    const int width = (overlap ? 2 : 1) * dim;
    CompressorWeights c;
    c.ratio = ratio;
    c.overlap = overlap;
    c.dim = dim;
    c.wkv = linear(width, D);
    c.wgate = linear(width, D);
    c.ape = uniform_matrix(ratio, width, 0.02f);
    c.norm = around_one(dim);
    return c;
  }

  ExpertWeights expert(int inter, int D) { return {linear(inter, D), linear(inter, D), linear(D, inter)}; }

  // [vocab, k] expert ids, distinct within each row (partial Fisher-Yates over 0..E-1).
  std::vector<int32_t> tid2eid(int vocab, int k, int n_experts) {
    std::vector<int32_t> ids(size_t(vocab) * k), pool(n_experts);
    for (int t = 0; t < vocab; ++t) {
      std::iota(pool.begin(), pool.end(), 0);
      for (int j = 0; j < k; ++j) {
        std::uniform_int_distribution<int> pick(j, n_experts - 1);
        std::swap(pool[j], pool[pick(rng_)]);
        ids[size_t(t) * k + j] = pool[j];
      }
    }
    return ids;
  }

 private:
  std::mt19937_64 rng_;
  SyntheticLinears linears_;
};

}  // namespace

ModelConfig flash_shaped_config(int n_routed_experts) {
  DSV4_CHECK(n_routed_experts >= 6, "flash-shaped model: {} routed experts per layer; top-6 routing needs at least 6",
             n_routed_experts);
  ModelConfig c;
  c.vocab_size = 129280;
  c.hidden_size = 4096;
  c.n_heads = 64;
  c.head_dim = 512;
  c.rope_dim = 64;
  c.q_lora_rank = 1024;
  c.o_groups = 8;
  c.o_lora_rank = 1024;
  c.window = 128;
  std::vector<int> ratios = {0, 0};  // spec 1.2: [0,0] + [4,128]x20 + [4]
  for (int i = 0; i < 20; ++i) ratios.push_back(4), ratios.push_back(128);
  ratios.push_back(4);
  set_layers(c, ratios, /*csa_ratio=*/4, /*n_hash_layers=*/3);
  c.index_n_heads = 64;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.n_routed_experts = n_routed_experts;
  c.moe_inter = 2048;
  set_v4_constants(c);
  c.validate();
  return c;
}

ModelConfig small_synthetic_config() {
  ModelConfig c;
  c.vocab_size = 300;
  c.hidden_size = 64;
  c.n_heads = 4;
  c.head_dim = 128;  // nope dims 64: the FP8 KV rounding works in 64-element blocks
  c.rope_dim = 64;
  c.q_lora_rank = 32;
  c.o_groups = 2;
  c.o_lora_rank = 16;
  c.window = 8;
  // HCA at ratio 8 (not 128) so that a test of a few dozen tokens emits compressed entries.
  set_layers(c, {0, 0, 4, 8, 4}, /*csa_ratio=*/4, /*n_hash_layers=*/3);
  c.index_n_heads = 2;
  c.index_head_dim = 64;
  c.index_topk = 4;
  c.n_routed_experts = 8;
  c.moe_inter = 32;
  set_v4_constants(c);
  c.validate();
  return c;
}

ModelWeights synthetic_weights(const ModelConfig& c, uint64_t seed, SyntheticLinears linears, bool mtp) {
  c.validate();
  Filler f(seed, linears);
  const int D = c.hidden_size, hc = c.hc_mult, n_mix = (2 + hc) * hc, H = c.n_heads, hd = c.head_dim;
  ModelWeights w;
  w.embed = f.linear(c.vocab_size, D);
  w.head = f.linear(c.vocab_size, D);
  w.norm = f.around_one(D);
  w.hc_head = f.hyper_conn(hc, 1, hc * D);
  // Block l (l = n_layers: the MTP block's, sliding window only, through ModelConfig's accessors).
  auto block = [&](int l) {
    LayerWeights L;
    L.attn_norm = f.around_one(D);
    L.ffn_norm = f.around_one(D);
    L.hc_attn = f.hyper_conn(n_mix, 3, hc * D);
    L.hc_ffn = f.hyper_conn(n_mix, 3, hc * D);

    AttentionWeights& A = L.attn;
    A.wq_a = f.linear(c.q_lora_rank, D);
    A.q_norm = f.around_one(c.q_lora_rank);
    A.wq_b = f.linear(H * hd, c.q_lora_rank);
    A.wkv = f.linear(hd, D);
    A.kv_norm = f.around_one(hd);
    A.wo_a = f.linear(c.o_groups * c.o_lora_rank, H * hd / c.o_groups);
    A.wo_b = f.linear(D, c.o_groups * c.o_lora_rank);
    A.sink = f.small(H, 0.01f);
    if (c.has_compressor(l)) A.compressor = f.compressor(c.ratio(l), c.is_csa(l), hd, D);
    if (c.is_csa(l)) {
      IndexerWeights I;
      I.wq_b = f.linear(c.index_n_heads * c.index_head_dim, c.q_lora_rank);
      I.weights_proj = f.dense(c.index_n_heads, D);
      I.compressor = f.compressor(c.ratio(l), /*overlap=*/true, c.index_head_dim, D);
      A.indexer = std::move(I);
    }

    MoEWeights& M = L.ffn;
    M.gate = f.dense(c.n_routed_experts, D);
    if (c.hashed(l)) M.tid2eid = f.tid2eid(c.vocab_size, c.n_experts_per_tok, c.n_routed_experts);
    else M.gate_bias = f.small(c.n_routed_experts, 0.01f);
    M.experts.reserve(c.n_routed_experts);
    for (int e = 0; e < c.n_routed_experts; ++e) M.experts.push_back(f.expert(c.moe_inter, D));
    if (c.n_shared_experts > 0) M.shared = f.expert(c.moe_inter * c.n_shared_experts, D);
    return L;
  };
  w.layers.reserve(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) w.layers.push_back(block(l));
  if (mtp) {  // drawn after the model's weights, which stay those of a model without it
    MtpWeights m;
    m.block = block(c.n_layers);
    m.e_proj = f.linear(D, D);
    m.h_proj = f.linear(D, D);
    m.enorm = f.around_one(D);
    m.hnorm = f.around_one(D);
    m.norm = f.around_one(D);
    m.hc_head = f.hyper_conn(hc, 1, hc * D);
    w.mtp = std::move(m);
  }
  return w;
}

}  // namespace dsv4
