// SPDX-License-Identifier: MIT
// What a checkpoint tensor is for, from its name alone (official DeepSeek names, with or without "model.", and
// the transformers spellings). Used by `dsv4 quantize` to pick what to quantise and by `dsv4 inspect` to group.
#pragma once
#include <string>
#include <string_view>

namespace dsv4 {

enum class TensorGroup {
  Embed, Head, HyperConn, Norm, Attention, Sinks, Compressor, Indexer, Router, RoutedExperts, SharedExperts, Mtp,
  Other
};
std::string_view group_name(TensorGroup g);  // "embed", "attention linears", ...
TensorGroup tensor_group(const std::string& name);

// Official-name roles that `dsv4 quantize` may convert (names with or without "model."):
// routed expert linears "layers.L.ffn.experts.E.w{1,2,3}.weight" (not MTP).
bool is_routed_expert_linear(const std::string& name);
// the FP8 linears of the release: attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b, ffn.shared_experts.w{1,2,3}.
bool is_big_linear(const std::string& name);
// Name of the linear that shares this one's input and so its NVFP4 weight_scale_2 (w3 -> w1, wkv -> wq_a);
// the name itself when it has no partner.
std::string input_partner_key(const std::string& name);

}  // namespace dsv4
