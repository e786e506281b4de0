// SPDX-License-Identifier: MIT
#include "quant/quantize.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "core/check.h"
#include "formats/blocks.h"
#include "formats/nvfp4.h"
#include "io/safetensors.h"
#include "quant/stored_weight.h"
#include "quant/tensor_groups.h"

namespace dsv4 {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {
// max(m, |v|) without libm's fmaxf call; NaN never wins (as with fmax).
inline float max_abs(float m, float v) { return std::fabs(v) > m ? std::fabs(v) : m; }
}  // namespace

float abs_max(std::span<const float> w) {
  float m = 0.0f;
  for (float v : w) m = max_abs(m, v);
  return m;
}

Nvfp4Matrix quantize_nvfp4(std::span<const float> w, int64_t rows, int64_t cols, float global_amax) {
  DSV4_CHECK(cols % kNvfp4GroupSize == 0, "quantize_nvfp4: K = {} is not a multiple of {}", cols, kNvfp4GroupSize);
  DSV4_CHECK(int64_t(w.size()) == rows * cols, "quantize_nvfp4: {} values for a [{}, {}] matrix", w.size(), rows, cols);
  DSV4_CHECK(std::isfinite(global_amax), "quantize_nvfp4: amax {} is not finite", global_amax);
  Nvfp4Matrix q;
  // An all-zero tensor would give ModelOpt a 0/0 block scale; any positive global scale encodes it as zeros.
  q.global_scale = global_amax > 0.0f ? nvfp4_global_scale(global_amax) : 1.0f;
  const int64_t groups = cols / kNvfp4GroupSize;
  q.packed.resize(size_t(rows * cols / 2));
  q.scale.resize(size_t(rows * groups));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* x = w.data() + r * cols + g * kNvfp4GroupSize;
      float block_amax = 0.0f;
      for (int k = 0; k < kNvfp4GroupSize; ++k) block_amax = max_abs(block_amax, x[k]);
      const uint8_t sc = nvfp4_block_scale_code(block_amax, q.global_scale);
      q.scale[size_t(r * groups + g)] = sc;
      const float s = e4m3_to_f32(sc);
      uint8_t* out = q.packed.data() + (r * cols + g * kNvfp4GroupSize) / 2;
      for (int k = 0; k < kNvfp4GroupSize; k += 2)
        out[k / 2] = pack_fp4_pair(nvfp4_encode(x[k], s, q.global_scale), nvfp4_encode(x[k + 1], s, q.global_scale));
    }
  }
  return q;
}

Fp8BlockMatrix quantize_fp8_block(std::span<const float> w, int64_t rows, int64_t cols) {
  DSV4_CHECK(int64_t(w.size()) == rows * cols, "quantize_fp8_block: {} values for a [{}, {}] matrix", w.size(), rows,
             cols);
  const int64_t bo = ceil_div(rows, kFp8BlockSize), bi = ceil_div(cols, kFp8BlockSize);
  Fp8BlockMatrix q;
  q.codes.resize(size_t(rows * cols));
  q.scale.resize(size_t(bo * bi));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t tr = 0; tr < bo; ++tr) {
    for (int64_t tc = 0; tc < bi; ++tc) {
      const int64_t r0 = tr * kFp8BlockSize, r1 = std::min(rows, r0 + kFp8BlockSize);
      const int64_t c0 = tc * kFp8BlockSize, c1 = std::min(cols, c0 + kFp8BlockSize);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) amax = max_abs(amax, w[size_t(r * cols + c)]);
      const uint8_t e = e8m0_scale_for(amax, kE4M3Max);
      q.scale[size_t(tr * bi + tc)] = e;
      const float s = e8m0_to_f32(e);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) q.codes[size_t(r * cols + c)] = f32_to_e4m3(w[size_t(r * cols + c)] / s);
    }
  }
  return q;
}

Mxfp4Matrix quantize_mxfp4(std::span<const float> w, int64_t rows, int64_t cols) {
  DSV4_CHECK(cols % 2 == 0, "quantize_mxfp4: K = {} is odd", cols);
  DSV4_CHECK(int64_t(w.size()) == rows * cols, "quantize_mxfp4: {} values for a [{}, {}] matrix", w.size(), rows, cols);
  const int64_t groups = ceil_div(cols, kMxfp4GroupSize);
  Mxfp4Matrix q;
  q.packed.resize(size_t(rows * cols / 2));
  q.scale.resize(size_t(rows * groups));
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = w.data() + r * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * kMxfp4GroupSize, c1 = std::min(cols, c0 + kMxfp4GroupSize);
      float amax = 0.0f;
      for (int64_t c = c0; c < c1; ++c) amax = max_abs(amax, x[c]);
      const uint8_t e = e8m0_scale_for(amax, kE2M1Max);
      q.scale[size_t(r * groups + g)] = e;
      const float s = e8m0_to_f32(e);
      for (int64_t c = c0; c < c1; c += 2)
        q.packed[size_t((r * cols + c) / 2)] = pack_fp4_pair(f32_to_e2m1(x[c] / s), f32_to_e2m1(x[c + 1] / s));
    }
  }
  return q;
}

QuantTarget parse_quant_target(const std::string& name) {
  if (name == "nvfp4") return QuantTarget::Nvfp4;
  if (name == "deepseek") return QuantTarget::DeepSeek;
  DSV4_FAIL("--format {}: expected nvfp4 (NVIDIA ModelOpt NVFP4 experts) or deepseek (official FP8 + FP4 layout)",
            name);
}

namespace {

enum class Action { Copy, Drop, Nvfp4, Fp8Block, Mxfp4 };

struct Planned {
  const TensorView* tensor = nullptr;
  Action action = Action::Copy;
  StoredWeight stored;  // for quantised actions: the input's storage (dequantised first)
};

// A tensor of the output shard: its own bytes (quantised) or a view of the input's mapped bytes (copied).
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  std::span<const uint8_t> input_bytes = {};
  std::span<const uint8_t> data() const { return bytes.empty() ? input_bytes : std::span<const uint8_t>(bytes); }
};

template <class T>
std::vector<uint8_t> as_bytes(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// "P.weight" -> "P.<suffix>" (every quantised role has an official ".weight" name).
std::string companion(const std::string& weight_name, const std::string& suffix) {
  return weight_name.substr(0, weight_name.size() - 6) + suffix;
}

Action action_for(const std::string& name, QuantTarget target, bool all_linears) {
  const bool expert = is_routed_expert_linear(name), big = is_big_linear(name);
  if (target == QuantTarget::Nvfp4) return (expert || (all_linears && big)) ? Action::Nvfp4 : Action::Copy;
  if (expert) return Action::Mxfp4;
  return big ? Action::Fp8Block : Action::Copy;
}

std::vector<float> dequantized(const StoredWeight& w) { return dequantize(w, w.logical_shape); }

// One input shard mapped on its own while it is processed, so that its pages are released (munmap) before the
// next shard: the checkpoint-wide mapping is only used for headers, and peak memory stays near one shard.
class ShardReader {
 public:
  explicit ShardReader(const std::string& path) : file_(SafetensorsFile::open(path)) {
    for (const TensorView& t : file_->tensors()) by_name_[t.name] = &t;
  }
  // `p` with every tensor it refers to taken from this shard's mapping where the shard holds it.
  Planned rebind(Planned p) const {
    auto local = [&](const TensorView* t) -> const TensorView* {
      if (!t) return t;
      auto it = by_name_.find(t->name);
      return it == by_name_.end() ? t : it->second;
    };
    p.tensor = local(p.tensor);
    p.stored.weight = local(p.stored.weight);
    p.stored.scale = local(p.stored.scale);
    p.stored.scale_2 = local(p.stored.scale_2);
    p.stored.input_scale = local(p.stored.input_scale);
    return p;
  }

 private:
  std::unique_ptr<SafetensorsFile> file_;
  std::map<std::string, const TensorView*> by_name_;
};

json read_json(const fs::path& p) {
  std::ifstream in(p);
  DSV4_CHECK(in.good(), "cannot open {}", p.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    DSV4_FAIL("{}: invalid JSON ({})", p.string(), e.what());
  }
}

void write_json(const fs::path& p, const json& j) {
  std::ofstream out(p);
  out << j.dump(2) << "\n";
  DSV4_CHECK(out.good(), "cannot write {}", p.string());
}

// Module-name patterns of the linears left unquantised, in ModelOpt's exclude_modules wildcard style.
std::vector<std::string> exclude_patterns(bool all_linears) {
  std::vector<std::string> p = {"embed", "head", "layers.*.ffn.gate", "layers.*.attn.compressor*",
                                "layers.*.attn.indexer.weights_proj", "layers.*.attn.indexer.compressor*", "mtp*"};
  if (!all_linears)
    for (const char* s : {"layers.*.attn.wq_a", "layers.*.attn.wq_b", "layers.*.attn.wkv", "layers.*.attn.wo_a",
                          "layers.*.attn.wo_b", "layers.*.attn.indexer.wq_b", "layers.*.ffn.shared_experts*"})
      p.emplace_back(s);
  return p;
}

}  // namespace

QuantizeReport quantize_checkpoint(const QuantizeOptions& o) {
  DSV4_CHECK(!o.model_dir.empty() && !o.out_dir.empty(), "quantize: --model and --out are required");
  DSV4_CHECK(fs::weakly_canonical(o.model_dir) != fs::weakly_canonical(o.out_dir),
             "quantize: --out {} must differ from --model", o.out_dir);
  const json config = read_json(fs::path(o.model_dir) / "config.json");
  const Checkpoint ckpt = Checkpoint::open(o.model_dir);
  QuantizeReport report;

  // 1. Plan: every tensor gets an action; companions of re-quantised weights are dropped, of copied ones kept.
  std::map<std::string, Planned> plan;
  std::set<std::string> companions_of_requantised;
  for (const auto& [name, t] : ckpt.tensors()) {
    Planned p{t, action_for(name, o.target, o.all_linears), {}};
    if (p.action != Action::Copy) {
      p.stored = classify_weight(ckpt, *t);
      DSV4_CHECK(p.stored.logical_shape.size() == 2, "quantize: tensor \"{}\" in {} has shape {}; only matrices are "
                 "quantised", name, t->file, t->shape_str());
      for (const TensorView* c : {p.stored.scale, p.stored.scale_2, p.stored.input_scale})
        if (c) companions_of_requantised.insert(c->name);
    }
    plan[name] = p;
  }
  for (const std::string& c : companions_of_requantised) plan[c].action = Action::Drop;
  int64_t n_fused = 0;
  for (const auto& [name, p] : plan)
    if (name.find("mlp.experts.gate_up_proj") != std::string::npos ||
        name.find("mlp.experts.down_proj") != std::string::npos)
      ++n_fused;
  if (n_fused)
    report.notes.push_back(fmt::format("{} fused transformers expert tensors (mlp.experts.gate_up_proj/down_proj) "
                                       "were copied unquantised; re-save with per-expert official names to quantise",
                                       n_fused));

  std::map<std::string, std::vector<std::string>> by_file;  // input shard -> tensors it holds (kept ones)
  for (const auto& [name, p] : plan)
    if (p.action != Action::Drop) by_file[p.tensor->file].push_back(name);

  // 2. Shared input => shared weight_scale_2 (ModelOpt unifies the amax of linears fused on one input).
  std::map<std::string, float> group_amax;
  if (o.target == QuantTarget::Nvfp4)
    for (const auto& [file, names] : by_file) {
      const ShardReader shard(file);
      for (const std::string& name : names)
        if (const Planned& p = plan.at(name); p.action == Action::Nvfp4) {
          float& a = group_amax[input_partner_key(name)];
          a = std::fmax(a, abs_max(dequantized(shard.rebind(p).stored)));
        }
    }

  // 3. Stream: one input shard in, one output shard out.
  fs::create_directories(o.out_dir);
  json weight_map = json::object();
  const int64_t total = int64_t(plan.size());
  int64_t done = 0;
  int shard_no = 0;
  for (const auto& [file, names] : by_file) {
    ++shard_no;
    const std::string shard =
        by_file.size() == 1 ? "model.safetensors"
                            : fmt::format("model-{:05d}-of-{:05d}.safetensors", shard_no, by_file.size());
    const ShardReader reader(file);
    std::vector<OwnedTensor> out;
    uint64_t pending = 0;  // bytes of `out`, for the progress report
    for (const std::string& name : names) {
      const size_t out_before = out.size();
      const Planned p = reader.rebind(plan.at(name));
      const TensorView& t = *p.tensor;
      switch (p.action) {
        case Action::Copy:
          out.push_back({name, t.dtype, t.shape, {}, std::span<const uint8_t>(t.data, t.nbytes)});
          ++report.copied;
          break;
        case Action::Nvfp4: {
          const int64_t rows = p.stored.logical_shape[0], cols = p.stored.logical_shape[1];
          const Nvfp4Matrix q = quantize_nvfp4(dequantized(p.stored), rows, cols, group_amax.at(input_partner_key(name)));
          out.push_back({name, DType::U8, {rows, cols / 2}, q.packed});
          out.push_back({companion(name, "weight_scale"), DType::F8_E4M3, {rows, cols / kNvfp4GroupSize}, q.scale});
          out.push_back({companion(name, "weight_scale_2"), DType::F32, {}, as_bytes(std::vector<float>{q.global_scale})});
          ++report.quantized;
          break;
        }
        case Action::Fp8Block: {
          const int64_t rows = p.stored.logical_shape[0], cols = p.stored.logical_shape[1];
          const Fp8BlockMatrix q = quantize_fp8_block(dequantized(p.stored), rows, cols);
          out.push_back({name, DType::F8_E4M3, {rows, cols}, q.codes});
          out.push_back({companion(name, "scale"), DType::F8_E8M0,
                         {ceil_div(rows, kFp8BlockSize), ceil_div(cols, kFp8BlockSize)}, q.scale});
          ++report.quantized;
          break;
        }
        case Action::Mxfp4: {
          const int64_t rows = p.stored.logical_shape[0], cols = p.stored.logical_shape[1];
          const Mxfp4Matrix q = quantize_mxfp4(dequantized(p.stored), rows, cols);
          out.push_back({name, DType::I8, {rows, cols / 2}, q.packed});
          out.push_back({companion(name, "scale"), DType::F8_E8M0, {rows, ceil_div(cols, kMxfp4GroupSize)}, q.scale});
          ++report.quantized;
          break;
        }
        case Action::Drop: break;
      }
      report.bytes_in += t.nbytes;
      for (size_t k = out_before; k < out.size(); ++k) pending += out[k].data().size();
      ++done;
      if (o.progress) o.progress(done, total, report.bytes_out + pending);
    }
    std::vector<TensorToWrite> views;
    for (const OwnedTensor& t : out) {
      DSV4_CHECK(!weight_map.contains(t.name), "quantize: output tensor \"{}\" would be written twice (the input "
                 "already has it as a companion of another tensor)", t.name);
      weight_map[t.name] = shard;
      views.push_back({t.name, t.dtype, t.shape, t.data()});
      report.bytes_out += t.data().size();
      ++report.tensors_out;
    }
    write_safetensors((fs::path(o.out_dir) / shard).string(), views, {{"format", "pt"}});
    ++report.shards;
  }
  for (const auto& [name, p] : plan)
    if (p.action == Action::Drop) {
      report.bytes_in += p.tensor->nbytes;
      if (o.progress) o.progress(++done, total, report.bytes_out);
    }
  report.tensors_in = total;
  if (report.shards > 1)
    write_json(fs::path(o.out_dir) / "model.safetensors.index.json",
               json{{"metadata", {{"total_size", report.bytes_out}}}, {"weight_map", weight_map}});

  // 4. config.json (+ hf_quant_config.json) and the other top-level files.
  json out_config = config;
  const json producer = {{"name", "modelopt"}, {"version", "dsv4-quantize"}};
  if (o.target == QuantTarget::DeepSeek) {
    out_config["quantization_config"] = {{"quant_method", "fp8"},        {"activation_scheme", "dynamic"},
                                         {"fmt", "e4m3"},                {"scale_fmt", "ue8m0"},
                                         {"weight_block_size", {128, 128}}};
    out_config["expert_dtype"] = "fp4";
  } else {
    const json exclude = exclude_patterns(o.all_linears);
    const json input_q = config.contains("quantization_config") ? config["quantization_config"] : json();
    if (input_q.is_object() && input_q.value("quant_method", "") == "fp8") {
      // Official FP8 input: NVIDIA's DeepSeek-V4 NVFP4 layout keeps the FP8 config and routes experts to NVFP4.
      json q = input_q;
      q["moe_quant_algo"] = "NVFP4";
      q["quant_algo"] = "MIXED_PRECISION";
      q["group_size"] = kNvfp4GroupSize;
      q["producer"] = producer;
      q["ignore"] = json::array({"mtp.*"});
      out_config["quantization_config"] = q;
    } else {
      out_config["quantization_config"] = {{"quant_method", "modelopt"}, {"quant_algo", "NVFP4"},
                                           {"group_size", kNvfp4GroupSize}, {"kv_cache_quant_algo", nullptr},
                                           {"producer", producer},        {"ignore", exclude}};
    }
    write_json(fs::path(o.out_dir) / "hf_quant_config.json",
               json{{"producer", producer},
                    {"quantization", {{"quant_algo", "NVFP4"}, {"kv_cache_quant_algo", nullptr},
                                      {"group_size", kNvfp4GroupSize}, {"exclude_modules", exclude}}}});
  }
  write_json(fs::path(o.out_dir) / "config.json", out_config);
  for (const auto& entry : fs::directory_iterator(o.model_dir)) {
    const std::string fname = entry.path().filename().string();
    if (!entry.is_regular_file() || fname == "config.json" || fname == "hf_quant_config.json" ||
        fname.find(".safetensors") != std::string::npos)
      continue;
    fs::copy_file(entry.path(), fs::path(o.out_dir) / fname, fs::copy_options::overwrite_existing);
  }
  return report;
}

}  // namespace dsv4
