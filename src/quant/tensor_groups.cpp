// SPDX-License-Identifier: MIT
#include "quant/tensor_groups.h"

#include <regex>

namespace dsv4 {
namespace {

std::string without_model_prefix(const std::string& name) {
  return name.rfind("model.", 0) == 0 ? name.substr(6) : name;
}

bool has(const std::string& s, std::string_view part) { return s.find(part) != std::string::npos; }

}  // namespace

std::string_view group_name(TensorGroup g) {
  switch (g) {
    case TensorGroup::Embed: return "embedding";
    case TensorGroup::Head: return "lm head";
    case TensorGroup::HyperConn: return "hyper-connections";
    case TensorGroup::Norm: return "norms";
    case TensorGroup::Attention: return "attention linears";
    case TensorGroup::Sinks: return "attention sinks";
    case TensorGroup::Compressor: return "kv compressors";
    case TensorGroup::Indexer: return "indexer";
    case TensorGroup::Router: return "router";
    case TensorGroup::RoutedExperts: return "routed experts";
    case TensorGroup::SharedExperts: return "shared experts";
    case TensorGroup::Mtp: return "mtp";
    case TensorGroup::Other: return "other";
  }
  return "?";
}

TensorGroup tensor_group(const std::string& full_name) {
  const std::string n = without_model_prefix(full_name);
  if (n.rfind("mtp.", 0) == 0) return TensorGroup::Mtp;
  if (has(n, "embed")) return TensorGroup::Embed;
  if (n.rfind("head.", 0) == 0 || n.rfind("lm_head.", 0) == 0) return TensorGroup::Head;
  if (has(n, "hc_") || has(n, "_hc.")) return TensorGroup::HyperConn;
  if (has(n, "indexer")) return TensorGroup::Indexer;
  if (has(n, "compressor")) return TensorGroup::Compressor;
  if (has(n, "norm")) return TensorGroup::Norm;
  if (has(n, "shared_experts")) return TensorGroup::SharedExperts;
  if (has(n, "experts")) return TensorGroup::RoutedExperts;
  if (has(n, "ffn.gate") || has(n, "mlp.gate")) return TensorGroup::Router;
  if (has(n, "attn_sink") || has(n, "sinks")) return TensorGroup::Sinks;
  if (has(n, "attn.")) return TensorGroup::Attention;
  return TensorGroup::Other;
}

bool is_routed_expert_linear(const std::string& name) {
  static const std::regex re(R"(layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight)");
  return std::regex_match(without_model_prefix(name), re);
}

bool is_big_linear(const std::string& name) {
  static const std::regex re(
      R"(layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight)");
  return std::regex_match(without_model_prefix(name), re);
}

std::string input_partner_key(const std::string& name) {
  auto replace_tail = [&](std::string_view from, std::string_view to) -> std::string {
    if (name.size() >= from.size() && name.compare(name.size() - from.size(), from.size(), from) == 0)
      return name.substr(0, name.size() - from.size()) + std::string(to);
    return {};
  };
  if (std::string k = replace_tail(".w3.weight", ".w1.weight"); !k.empty()) return k;
  if (std::string k = replace_tail("attn.wkv.weight", "attn.wq_a.weight"); !k.empty()) return k;
  return name;
}

}  // namespace dsv4
