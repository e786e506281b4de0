// SPDX-License-Identifier: MIT
#include "quant/inspect.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/format.h>

#include "core/check.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "quant/stored_weight.h"

namespace dsv4 {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string describe(const StoredWeight& w) {
  switch (w.format) {
    case WeightFormat::Float: return lower(dtype_name(w.weight->dtype));
    case WeightFormat::Fp8Block:
    case WeightFormat::Fp8Tensor:
      return fmt::format("{} ({} scales)", format_name(w.format),
                         w.scale->dtype == DType::F8_E8M0 ? "e8m0" : lower(dtype_name(w.scale->dtype)));
    default: return std::string(format_name(w.format));
  }
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024.0 && u < 4) b /= 1024.0, ++u;
  return u == 0 ? fmt::format("{:.0f} B", b) : fmt::format("{:.2f} {}", b, units[u]);
}

}  // namespace

namespace {

// The weights the engine loads as linear layers (model/weights.cpp's WeightReader::linear): the head and the
// matrices of attention, compressors, indexer and experts, not the compressors' ape, the indexer's weights_proj, the
// norms or the router.
bool is_loaded_linear(const StoredWeight& w, TensorGroup g) {
  const std::string& name = w.weight->name;
  const bool linear_group = g == TensorGroup::Head || g == TensorGroup::Attention || g == TensorGroup::Compressor ||
                            g == TensorGroup::Indexer || g == TensorGroup::RoutedExperts ||
                            g == TensorGroup::SharedExperts;
  return linear_group && w.logical_shape.size() >= 2 && name.size() > 7 &&
         name.compare(name.size() - 7, 7, ".weight") == 0 && name.find("weights_proj") == std::string::npos &&
         name.find("norm") == std::string::npos;
}

}  // namespace

InspectReport inspect_checkpoint(const std::string& model_dir) {
  const ModelConfig config = ModelConfig::from_model_dir(model_dir);
  const Checkpoint ckpt = Checkpoint::open(model_dir);
  InspectReport r;
  r.config_summary = config.summary();
  if (!config.quantization_config.is_null()) r.quantization_config = config.quantization_config.dump();

  // Weights first, so that their companions are known before the leftovers are counted as tensors of their own.
  std::vector<StoredWeight> weights;
  std::set<std::string> companions;
  for (const auto& [name, t] : ckpt.tensors()) {
    if (t->dtype != DType::F8_E4M3 && t->dtype != DType::I8 && t->dtype != DType::U8) continue;
    StoredWeight w;
    try {
      w = classify_weight(ckpt, *t);
    } catch (const Error&) {
      continue;  // no scale beside it: a plain byte tensor (counted below as such)
    }
    for (const TensorView* c : {w.scale, w.scale_2, w.input_scale})
      if (c) companions.insert(c->name);
    weights.push_back(w);
  }
  std::set<std::string> quantised;
  for (const StoredWeight& w : weights) quantised.insert(w.weight->name);
  for (const auto& [name, t] : ckpt.tensors()) {
    if (quantised.count(name) || companions.count(name)) continue;
    StoredWeight w;
    w.weight = t;
    w.logical_shape = t->shape;
    weights.push_back(w);
  }

  const double expert_fraction =
      config.n_routed_experts > 0 ? double(config.n_experts_per_tok) / config.n_routed_experts : 1.0;
  std::map<std::pair<int, std::string>, InspectRow> rows;
  for (const StoredWeight& w : weights) {
    const TensorGroup g = tensor_group(w.weight->name);
    const std::string format = describe(w);
    InspectRow& row = rows[{int(g), format}];
    row.group = g;
    row.format = format;
    int64_t params = 1;
    for (int64_t d : w.logical_shape) params *= d;
    const uint64_t bytes = uint64_t(w.bytes());
    double per_token = double(bytes);
    const bool one_row = g == TensorGroup::Embed || w.weight->name.find("tid2eid") != std::string::npos;
    if (one_row && !w.logical_shape.empty() && w.logical_shape[0] > 0) per_token /= double(w.logical_shape[0]);
    if (g == TensorGroup::RoutedExperts) per_token *= expert_fraction;
    if (g == TensorGroup::Mtp) per_token = 0;
    row.tensors += 1;
    row.params += params;
    row.bytes += bytes;
    row.bytes_per_token += uint64_t(per_token + 0.5);
    if (g != TensorGroup::Mtp) {
      const uint64_t fp32 = uint64_t(params) * 4, bf16 = uint64_t(params) * 2;
      const bool linear = is_loaded_linear(w, g);
      const bool packable = linear && (w.format == WeightFormat::Nvfp4 || w.format == WeightFormat::Mxfp4 ||
                                       (w.format == WeightFormat::Fp8Block && w.scale &&
                                        (w.scale->dtype == DType::F8_E8M0 || w.scale->dtype == DType::F32)) ||
                                       (w.format == WeightFormat::Float && w.weight->dtype == DType::BF16));
      r.cpu_fp32_bytes += fp32;
      r.cpu_packed_bytes += packable ? bytes : fp32;
      r.gpu_bytes += packable ? bytes : linear || g == TensorGroup::Embed ? bf16 : fp32;
    }
  }
  for (auto& [key, row] : rows) {
    r.params += row.params;
    r.bytes += row.bytes;
    r.bytes_per_token += row.bytes_per_token;
    r.rows.push_back(row);
  }
  return r;
}

std::string format_report(const InspectReport& r) {
  std::string s = fmt::format("config: {}\n", r.config_summary);
  s += fmt::format("quantization_config: {}\n\n", r.quantization_config.empty() ? "(none)" : r.quantization_config);
  s += fmt::format("{:<20} {:<28} {:>8} {:>16} {:>12} {:>14}\n", "group", "format", "tensors", "params", "on disk",
                   "per token");
  for (const InspectRow& row : r.rows)
    s += fmt::format("{:<20} {:<28} {:>8} {:>16} {:>12} {:>14}\n", group_name(row.group), row.format, row.tensors,
                     row.params, human_bytes(double(row.bytes)), human_bytes(double(row.bytes_per_token)));
  s += fmt::format("{:<20} {:<28} {:>8} {:>16} {:>12} {:>14}\n", "total", "", "", r.params,
                   human_bytes(double(r.bytes)), human_bytes(double(r.bytes_per_token)));
  s += fmt::format("\nparameters: {} ({:.3f} B); bytes on disk: {} ({}); bytes read per decoded token (batch 1): {} "
                   "({})\n", r.params, r.params / 1e9, r.bytes, human_bytes(double(r.bytes)), r.bytes_per_token,
                   human_bytes(double(r.bytes_per_token)));
  // GPUs of each kind the weights need, at the memory a run finds free on them (H100 80GB: ~78 GiB, H200: ~139 GiB),
  // less 10 % for per-sequence state and workspaces.
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  auto gpus = [&](double free_gib) { return int(std::ceil(double(r.gpu_bytes) / (0.9 * free_gib * kGiB))); };
  auto split = [](int n) {
    std::string list;
    for (int i = 0; i < n; ++i) {
      if (i) list += ',';
      list += std::to_string(i);
    }
    return n == 1 ? std::string("one GPU") : fmt::format("--gpus {}", list);
  };
  s += fmt::format("\nmemory for the weights (MTP block aside; per-sequence state and workspaces on top):\n");
  s += fmt::format("  --device cpu --cpu-weights fp32     {}\n", human_bytes(double(r.cpu_fp32_bytes)));
  s += fmt::format("  --device cpu --cpu-weights packed   {} (linear layers mapped from the files)\n",
                   human_bytes(double(r.cpu_packed_bytes)));
  s += fmt::format("  --device cuda                       {}: H100 80GB x {} ({}), H200 x {} ({})\n",
                   human_bytes(double(r.gpu_bytes)), gpus(78), split(gpus(78)), gpus(139), split(gpus(139)));
  return s;
}

}  // namespace dsv4
