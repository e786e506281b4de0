// SPDX-License-Identifier: MIT
// The weight table: every tensor the config implies is looked up by its official name, checked for shape and
// dtype, and decoded to fp32. One reader records what it consumed so leftovers can be reported.
#include "model/weights.h"

#include <spdlog/spdlog.h>

#include <array>
#include <set>
#include <string_view>

#include <fmt/ranges.h>

#include "core/check.h"
#include "io/safetensors.h"
#include "quant/stored_weight.h"

namespace dsv4 {
namespace {

// Official name suffix -> other spellings found in checkpoints (inside "layers.N." / "model.layers.N.", or
// global): transformers' in-memory names, and the few names transformers' save_pretrained writes differently.
// A suffix may have several entries.
struct NameAlias {
  std::string_view official, other;
};
constexpr NameAlias kAliases[] = {
    {"embed.weight", "model.embed_tokens.weight"},
    {"head.weight", "lm_head.weight"},
    {"norm.weight", "model.norm.weight"},
    {"hc_head_fn", "model.hc_head.hc_fn"},
    {"hc_head_base", "model.hc_head.hc_base"},
    {"hc_head_scale", "model.hc_head.hc_scale"},
    {"attn_norm.weight", "input_layernorm.weight"},
    {"ffn_norm.weight", "post_attention_layernorm.weight"},
    {"hc_attn_fn", "attn_hc.fn"},
    {"hc_attn_base", "attn_hc.base"},
    {"hc_attn_scale", "attn_hc.scale"},
    {"hc_ffn_fn", "ffn_hc.fn"},
    {"hc_ffn_base", "ffn_hc.base"},
    {"hc_ffn_scale", "ffn_hc.scale"},
    {"attn.wq_a.weight", "self_attn.q_a_proj.weight"},
    {"attn.q_norm.weight", "self_attn.q_a_norm.weight"},
    {"attn.wq_b.weight", "self_attn.q_b_proj.weight"},
    {"attn.wkv.weight", "self_attn.kv_proj.weight"},
    {"attn.kv_norm.weight", "self_attn.kv_norm.weight"},
    {"attn.kv_norm.weight", "attn.norm.weight"},  // transformers save_pretrained
    {"attn.wo_a.weight", "self_attn.o_a_proj.weight"},
    {"attn.wo_b.weight", "self_attn.o_b_proj.weight"},
    {"attn.attn_sink", "self_attn.sinks"},
    {"attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"},
    {"attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"},
    {"attn.compressor.ape", "self_attn.compressor.position_bias"},
    {"attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"},
    {"attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"},
    {"attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.weights_proj.weight"},
    {"attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"},
    {"attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"},
    {"attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"},
    {"attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"},
    {"attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"},
    {"ffn.gate.weight", "mlp.gate.weight"},
    {"ffn.gate.bias", "mlp.gate.e_score_correction_bias"},
    {"ffn.gate.tid2eid", "mlp.gate.tid2eid"},
    {"ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
    {"ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
    {"ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
};

// Every name under which `official` may be stored, most likely first.
std::vector<std::string> candidate_names(const std::string& official) {
  std::vector<std::string> names = {official, "model." + official};
  std::string layer_prefix, rest = official;
  // Block tensors ("layers.<l>.", the MTP block's "mtp.0.") take the aliases of what follows the prefix.
  for (const char* block : {"layers.", "mtp."}) {
    if (official.rfind(block, 0) != 0) continue;
    const size_t dot = official.find('.', std::string_view(block).size());
    layer_prefix = official.substr(0, dot + 1);
    rest = official.substr(dot + 1);
  }
  for (const auto& [from, to] : kAliases) {
    if (rest != from) continue;
    const std::string other(to);
    if (layer_prefix.empty()) {
      names.push_back(other);
    } else {
      names.push_back("model." + layer_prefix + other);
      names.push_back(layer_prefix + other);
    }
  }
  return names;
}

class WeightReader {
 public:
  WeightReader(const Checkpoint& c, WeightLoad mode) : checkpoint_(c), mode_(mode) {}

  const Checkpoint& checkpoint() const { return checkpoint_; }

  const TensorView* find(const std::string& official) {
    for (const std::string& name : candidate_names(official)) {
      if (const TensorView* t = checkpoint_.find(name)) {
        used_.insert(name);
        return t;
      }
    }
    return nullptr;
  }

  const TensorView& require(const std::string& official) {
    const TensorView* t = find(official);
    DSV4_CHECK(t, "checkpoint {}: missing tensor \"{}\" (looked for: {})", checkpoint_.dir(), official,
               fmt::join(candidate_names(official), ", "));
    return *t;
  }

  std::vector<float> decode(const TensorView& t, const std::vector<int64_t>& shape) {
    const StoredWeight stored = classify_weight(checkpoint_, t);
    for (const TensorView* companion : {stored.scale, stored.scale_2, stored.input_scale})
      if (companion) used_.insert(companion->name);
    return dequantize(stored, shape);
  }

  Matrix matrix(const std::string& name, int rows, int cols) {
    Matrix m{rows, cols, decode(require(name), {rows, cols}), std::nullopt};
    return m;
  }

  // A linear layer's weight: packed when the mode asks for it and the encoding allows, else fp32.
  Matrix linear(const std::string& name, int rows, int cols) {
    const TensorView& t = require(name);
    if (mode_ == WeightLoad::KeepLinearsPacked) {
      const StoredWeight stored = classify_weight(checkpoint_, t);
      if (std::optional<PackedWeight> p = pack(stored, {rows, cols}, 0, 0, rows)) return {rows, cols, {}, *p};
    }
    return matrix(name, rows, cols);
  }

  // Rows [row0, row0 + rows) of matrix `index` of a stored tensor of logical shape `shape`, packed; nullopt (the
  // caller decodes) when the encoding has no packed form. The values are checked here either way.
  std::optional<PackedWeight> pack(const StoredWeight& stored, const std::vector<int64_t>& shape, int64_t index,
                                   int64_t row0, int64_t rows) {
    if (mode_ != WeightLoad::KeepLinearsPacked) return std::nullopt;
    std::string why;
    std::optional<PackedWeight> p = packed_view(stored, index, row0, rows, &why);
    if (!p) {
      if (refused_.insert(why).second)
        spdlog::info("weights like \"{}\" are decoded (to fp32 on the CPU, bf16 on the GPU): {}", stored.weight->name,
                     why);
      return std::nullopt;
    }
    if (validated_.insert(stored.weight->name).second) {  // same checks as the decoding path, values dropped
      for (const TensorView* companion : {stored.scale, stored.scale_2, stored.input_scale})
        if (companion) used_.insert(companion->name);
      (void)dequantize(stored, shape);
    }
    return p;
  }
  Vector vector(const std::string& name, int n) { return decode(require(name), {n}); }

  void report_unused() const {
    std::vector<std::string> unused;
    int n_mtp = 0;
    for (const auto& [name, t] : checkpoint_.tensors()) {
      if (used_.count(name)) continue;
      if (name.rfind("mtp.", 0) == 0 || name.rfind("model.mtp.", 0) == 0) ++n_mtp;
      else unused.push_back(name);
    }
    if (n_mtp) spdlog::info("checkpoint has {} MTP tensors, not loaded (--speculate mtp uses them)", n_mtp);
    if (!unused.empty())
      spdlog::warn("checkpoint has {} tensors the engine does not use, e.g. \"{}\"", unused.size(), unused.front());
  }

 private:
  const Checkpoint& checkpoint_;
  const WeightLoad mode_;
  std::set<std::string> used_, validated_, refused_;
};

HyperConnWeights load_hc(WeightReader& r, const std::string& prefix, int n_mix, int n_scale, int width) {
  return {r.matrix(prefix + "fn", n_mix, width), r.vector(prefix + "base", n_mix), r.vector(prefix + "scale", n_scale)};
}

CompressorWeights load_compressor(WeightReader& r, const std::string& p, int ratio, bool overlap, int dim, int D) {
  const int width = (overlap ? 2 : 1) * dim;
  CompressorWeights c;
  c.ratio = ratio;
  c.overlap = overlap;
  c.dim = dim;
  c.wkv = r.linear(p + "wkv.weight", width, D);
  c.wgate = r.linear(p + "wgate.weight", width, D);
  c.ape = r.matrix(p + "ape", ratio, width);
  c.norm = r.vector(p + "norm.weight", dim);
  return c;
}

// Routed experts: official per-expert tensors, or transformers' fused [E, 2I, D] gate_up / [E, D, I] down.
std::vector<ExpertWeights> load_experts(WeightReader& r, const std::string& p, const ModelConfig& c) {
  const int E = c.n_routed_experts, I = c.moe_inter, D = c.hidden_size;
  std::vector<ExpertWeights> experts(E);
  if (r.find(p + "ffn.experts.0.w1.weight")) {
    for (int e = 0; e < E; ++e) {
      const std::string q = p + "ffn.experts." + std::to_string(e) + ".";
      experts[e].w1 = r.linear(q + "w1.weight", I, D);
      experts[e].w3 = r.linear(q + "w3.weight", I, D);
      experts[e].w2 = r.linear(q + "w2.weight", D, I);
    }
    return experts;
  }
  const std::string hf = "model." + p + "mlp.experts.";
  const TensorView* gate_up = r.find(hf + "gate_up_proj");
  const TensorView* down = r.find(hf + "down_proj");
  DSV4_CHECK(gate_up && down, "checkpoint: missing routed experts for {} (neither \"{}ffn.experts.0.w1.weight\" "
             "nor \"{}gate_up_proj\")", p, p, hf);
  {  // packed slices of the fused tensors, when both allow it for every expert
    const StoredWeight gu = classify_weight(r.checkpoint(), *gate_up), dn = classify_weight(r.checkpoint(), *down);
    bool all = true;
    for (int e = 0; e < E && all; ++e) {
      auto w1 = r.pack(gu, {E, 2 * I, D}, e, 0, I), w3 = r.pack(gu, {E, 2 * I, D}, e, I, I);
      auto w2 = r.pack(dn, {E, D, I}, e, 0, D);
      all = w1 && w3 && w2;
      if (all) experts[e] = {{I, D, {}, *w1}, {I, D, {}, *w3}, {D, I, {}, *w2}};
    }
    if (all) return experts;
  }
  const std::vector<float> gu = r.decode(*gate_up, {E, 2 * I, D});
  const std::vector<float> dn = r.decode(*down, {E, D, I});
  const int64_t mat = int64_t(I) * D;
  for (int e = 0; e < E; ++e) {
    const float* g = gu.data() + int64_t(e) * 2 * mat;
    experts[e].w1 = {I, D, std::vector<float>(g, g + mat), std::nullopt};
    experts[e].w3 = {I, D, std::vector<float>(g + mat, g + 2 * mat), std::nullopt};
    experts[e].w2 = {D, I, std::vector<float>(dn.data() + int64_t(e) * mat, dn.data() + int64_t(e + 1) * mat),
                     std::nullopt};
  }
  return experts;
}

}  // namespace

// The tensors of block l (prefix "layers.<l>." or, for l = n_layers, the MTP block's "mtp.0.").
static LayerWeights load_layer(WeightReader& r, const ModelConfig& c, int l, const std::string& p) {
  const int D = c.hidden_size, hc = c.hc_mult, n_mix = (2 + hc) * hc;
  LayerWeights L;
  L.attn_norm = r.vector(p + "attn_norm.weight", D);
  L.ffn_norm = r.vector(p + "ffn_norm.weight", D);
  L.hc_attn = load_hc(r, p + "hc_attn_", n_mix, 3, hc * D);
  L.hc_ffn = load_hc(r, p + "hc_ffn_", n_mix, 3, hc * D);

  AttentionWeights& A = L.attn;
  const int H = c.n_heads, hd = c.head_dim;
  A.wq_a = r.linear(p + "attn.wq_a.weight", c.q_lora_rank, D);
  A.q_norm = r.vector(p + "attn.q_norm.weight", c.q_lora_rank);
  A.wq_b = r.linear(p + "attn.wq_b.weight", H * hd, c.q_lora_rank);
  A.wkv = r.linear(p + "attn.wkv.weight", hd, D);
  A.kv_norm = r.vector(p + "attn.kv_norm.weight", hd);
  A.wo_a = r.linear(p + "attn.wo_a.weight", c.o_groups * c.o_lora_rank, H * hd / c.o_groups);
  A.wo_b = r.linear(p + "attn.wo_b.weight", D, c.o_groups * c.o_lora_rank);
  A.sink = r.vector(p + "attn.attn_sink", H);
  if (c.has_compressor(l))
    A.compressor = load_compressor(r, p + "attn.compressor.", c.ratio(l), c.is_csa(l), hd, D);
  if (c.is_csa(l)) {
    IndexerWeights I;
    I.wq_b = r.linear(p + "attn.indexer.wq_b.weight", c.index_n_heads * c.index_head_dim, c.q_lora_rank);
    I.weights_proj = r.matrix(p + "attn.indexer.weights_proj.weight", c.index_n_heads, D);
    I.compressor = load_compressor(r, p + "attn.indexer.compressor.", c.ratio(l), true,
                                   c.index_head_dim, D);
    A.indexer = std::move(I);
  }

  MoEWeights& M = L.ffn;
  M.gate = r.matrix(p + "ffn.gate.weight", c.n_routed_experts, D);
  if (c.hashed(l)) {
    const TensorView& t = r.require(p + "ffn.gate.tid2eid");
    DSV4_CHECK(t.shape == std::vector<int64_t>({c.vocab_size, c.n_experts_per_tok}),
               "tensor \"{}\": expected shape [{}, {}], got {}", t.name, c.vocab_size, c.n_experts_per_tok,
               t.shape_str());
    for (int64_t v : to_i64(t)) {
      DSV4_CHECK(v >= 0 && v < c.n_routed_experts, "tensor \"{}\": expert id {} out of range [0, {})", t.name, v,
                 c.n_routed_experts);
      M.tid2eid.push_back(int32_t(v));
    }
  } else {
    M.gate_bias = r.vector(p + "ffn.gate.bias", c.n_routed_experts);
  }
  M.experts = load_experts(r, p, c);
  if (c.n_shared_experts > 0) {
    const int I = c.moe_inter * c.n_shared_experts;
    M.shared = ExpertWeights{r.linear(p + "ffn.shared_experts.w1.weight", I, D),
                             r.linear(p + "ffn.shared_experts.w3.weight", I, D),
                             r.linear(p + "ffn.shared_experts.w2.weight", D, I)};
  }
  return L;
}

ModelWeights load_weights(const ModelConfig& c, std::shared_ptr<const Checkpoint> storage, WeightLoad mode,
                          bool mtp) {
  DSV4_CHECK(storage, "load_weights: no checkpoint");
  const Checkpoint& checkpoint = *storage;
  WeightReader r(checkpoint, mode);
  const int D = c.hidden_size, hc = c.hc_mult;
  ModelWeights w;
  w.embed = r.matrix("embed.weight", c.vocab_size, D);
  w.head = r.linear("head.weight", c.vocab_size, D);
  w.norm = r.vector("norm.weight", D);
  w.hc_head = load_hc(r, "hc_head_", hc, 1, hc * D);
  w.layers.reserve(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) w.layers.push_back(load_layer(r, c, l, "layers." + std::to_string(l) + "."));
  if (mtp) {
    DSV4_CHECK(c.n_mtp_layers > 0 && r.find("mtp.0.attn_norm.weight"),
               "checkpoint {} has no MTP block (num_nextn_predict_layers = {}, no \"mtp.0.*\" tensors; exports "
               "through transformers drop them)", checkpoint.dir(), c.n_mtp_layers);
    const std::string p = "mtp.0.";
    MtpWeights m;
    m.block = load_layer(r, c, c.n_layers, p);
    m.e_proj = r.linear(p + "e_proj.weight", D, D);
    m.h_proj = r.linear(p + "h_proj.weight", D, D);
    m.enorm = r.vector(p + "enorm.weight", D);
    m.hnorm = r.vector(p + "hnorm.weight", D);
    m.norm = r.vector(p + "norm.weight", D);
    m.hc_head = load_hc(r, p + "hc_head_", hc, 1, hc * D);
    w.mtp = std::move(m);
  }
  r.report_unused();
  if (mode == WeightLoad::KeepLinearsPacked) w.storage = std::move(storage);
  return w;
}

namespace {
template <class W, class M>
std::vector<M*> linears_of(W& w) {
  std::vector<M*> out = {&w.embed, &w.head};
  auto block = [&](auto& L) {
    auto& A = L.attn;
    for (M* m : {&A.wq_a, &A.wq_b, &A.wkv, &A.wo_a, &A.wo_b}) out.push_back(m);
    if (A.compressor) out.push_back(&A.compressor->wkv), out.push_back(&A.compressor->wgate);
    if (A.indexer)
      for (M* m : {&A.indexer->wq_b, &A.indexer->compressor.wkv, &A.indexer->compressor.wgate}) out.push_back(m);
    for (auto& e : L.ffn.experts) out.push_back(&e.w1), out.push_back(&e.w2), out.push_back(&e.w3);
    if (L.ffn.shared) out.push_back(&L.ffn.shared->w1), out.push_back(&L.ffn.shared->w2), out.push_back(&L.ffn.shared->w3);
  };
  for (auto& L : w.layers) block(L);
  if (w.mtp) {
    block(w.mtp->block);
    out.push_back(&w.mtp->e_proj);
    out.push_back(&w.mtp->h_proj);
  }
  return out;
}
}  // namespace

std::vector<Matrix*> linear_matrices(ModelWeights& w) { return linears_of<ModelWeights, Matrix>(w); }
std::vector<const Matrix*> linear_matrices(const ModelWeights& w) {
  return linears_of<const ModelWeights, const Matrix>(w);
}

}  // namespace dsv4
