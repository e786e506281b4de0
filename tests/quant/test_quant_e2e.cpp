// SPDX-License-Identifier: MIT
// End to end: `dsv4 quantize` on a tiny fp32 checkpoint in each output format, then the engine on the quantised
// checkpoint must give the same logits (<= 1e-4, fp32 numerics) as on an fp32 checkpoint holding the exactly
// dequantised weights. Where reference logits computed by transformers on those dequantised weights are committed
// (tests/data/quant/*.npy, reference/quant/transformers_logits.py), the engine must match them within 1e-3.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/npy.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "quant/inspect.h"
#include "quant/stored_weight.h"
#include "core/check.h"
#include "model/state.h"
#include "model/synthetic.h"
#include "tiny_checkpoint.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

// This process's scratch directory, removed again when the process exits.
const fs::path& work_dir() {
  struct Scratch {
    fs::path dir = fs::temp_directory_path() / ("dsv4_quant_e2e_" + std::to_string(getpid()));
    Scratch() {
      fs::remove_all(dir);
      fs::create_directories(dir);
    }
    ~Scratch() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  };
  static const Scratch scratch;
  return scratch.dir;
}

// The fp32 source: the seeded generator's tiny model (the committed transformers logits are for exactly it).
const std::string& source_dir() {
  static const std::string dir = [] {
    const fs::path d = work_dir() / "tiny-fp32";
    dsv4::testing::write_tiny_checkpoint(d.string(), 20261202);
    return d.string();
  }();
  return dir;
}

int run_cli(const std::string& args, const fs::path& log) {
  const std::string cmd = std::string(DSV4_BINARY) + " " + args + " > " + log.string() + " 2>&1";
  return std::system(cmd.c_str());
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> logits_of(const std::string& dir) {
  const Model model = Model::load(dir, Numerics{cpu::KvStorage::F32, cpu::IndexerStorage::F32});
  const std::vector<int32_t> prompt = dsv4::testing::quant_test_prompt();
  SequenceState state = model.new_sequence(int(prompt.size()) + 4);
  return model.forward(state, prompt, /*last_only=*/false);
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    if (!(d <= worst)) worst = std::isnan(d) ? INFINITY : d;
  }
  return worst;
}

struct Variant {
  std::string name, args;
  WeightFormat expert_format, attention_format;
};

// Quantises the source once per variant (cached across tests); returns the output dir.
std::string quantised(const Variant& v, const std::string& from) {
  const fs::path out = work_dir() / v.name;
  if (!fs::exists(out / "config.json")) {
    const int rc = run_cli("quantize --model " + from + " --out " + out.string() + " " + v.args,
                           work_dir() / (v.name + ".log"));
    EXPECT_EQ(rc, 0) << slurp(work_dir() / (v.name + ".log"));
  }
  return out.string();
}

const Variant kNvfp4{"nvfp4", "--format nvfp4", WeightFormat::Nvfp4, WeightFormat::Float};
const Variant kNvfp4All{"nvfp4-all", "--format nvfp4 --all-linears", WeightFormat::Nvfp4, WeightFormat::Nvfp4};
const Variant kDeepSeek{"deepseek", "--format deepseek", WeightFormat::Mxfp4, WeightFormat::Fp8Block};

// Formats of one routed expert and one attention linear as stored.
std::pair<WeightFormat, WeightFormat> formats_of(const std::string& dir) {
  const Checkpoint c = Checkpoint::open(dir);
  const TensorView* expert = c.find("model.layers.0.ffn.experts.0.w1.weight");
  if (!expert) expert = c.find("layers.0.ffn.experts.0.w1.weight");
  const TensorView* wq_a = c.find("model.layers.0.attn.wq_a.weight");
  if (!wq_a) wq_a = c.find("layers.0.attn.wq_a.weight");
  EXPECT_TRUE(expert && wq_a);
  if (!expert || !wq_a) return {};
  return {classify_weight(c, *expert).format, classify_weight(c, *wq_a).format};
}

void check_variant(const Variant& v, const std::string& from) {
  const std::string q = quantised(v, from);
  const auto [expert, attention] = formats_of(q);
  EXPECT_EQ(expert, v.expert_format);
  EXPECT_EQ(attention, v.attention_format);
  const fs::path deq = work_dir() / (v.name + "-dequantised");
  if (!fs::exists(deq / "config.json")) dsv4::testing::write_dequantised_checkpoint(q, deq.string());
  const std::vector<float> a = logits_of(q), b = logits_of(deq.string());
  const double d = max_abs_diff(a, b);
  std::printf("%s: max |logit diff| quantised vs dequantised fp32 checkpoint = %.3g\n", v.name.c_str(), d);
  EXPECT_LE(d, 1e-4);
  const double vs_source = max_abs_diff(a, logits_of(from));
  std::printf("%s: max |logit diff| vs the input checkpoint (quantisation error, informative) = %.3g\n",
              v.name.c_str(), vs_source);
  EXPECT_TRUE(std::isfinite(vs_source));

  // Reference logits from transformers on the same dequantised weights, when committed for this source.
  const fs::path ref = fs::path(DSV4_TEST_DATA) / "quant" / (v.name + "-transformers.npy");
  if (from == source_dir() && (v.name == "nvfp4" || v.name == "nvfp4-all" || v.name == "deepseek")) {
    ASSERT_TRUE(fs::exists(ref)) << ref;
    const NpyArray r = read_npy(ref.string());
    ASSERT_EQ(r.values.size(), a.size());
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::fmax(worst, std::fabs(double(a[i]) - r.values[i]));
    std::printf("%s: max |logit diff| engine on quantised checkpoint vs transformers on dequantised = %.3g\n",
                v.name.c_str(), worst);
    EXPECT_LE(worst, 1e-3);
  }
}

}  // namespace

TEST(QuantE2E, Nvfp4ExpertsMatchDequantisedFp32) { check_variant(kNvfp4, source_dir()); }
TEST(QuantE2E, Nvfp4AllLinearsMatchDequantisedFp32) { check_variant(kNvfp4All, source_dir()); }
TEST(QuantE2E, DeepSeekFp8Fp4MatchDequantisedFp32) { check_variant(kDeepSeek, source_dir()); }

// The CPU backend on packed weights (WeightLoad::KeepLinearsPacked, --cpu-weights packed): every packed view of a
// quantised checkpoint decodes to dequantize's bits (decode_packed_rows), and the forward pass, a 12-token prefill
// (BLAS on decoded tiles) then 6 decode steps (the per-thread dot products), gives the logits of the fp32 weights to
// fp32 summation order (<= 1e-5 of the largest logit; measured 4-7e-7) with the same greedy tokens.
void check_packed_cpu(const Variant& v) {
  const std::string q = quantised(v, source_dir());
  const Checkpoint checkpoint = Checkpoint::open(q);
  int views = 0;
  for (const auto& [name, t] : checkpoint.tensors()) {
    if (name.size() < 7 || name.compare(name.size() - 7, 7, ".weight") != 0 || t->shape.size() != 2) continue;
    const StoredWeight stored = classify_weight(checkpoint, *t);
    const int64_t rows = stored.logical_shape[0], cols = stored.logical_shape[1];
    std::string why;
    const std::optional<PackedWeight> view = packed_view(stored, 0, 0, rows, &why);
    if (!view) continue;
    const std::vector<float> want = dequantize(stored, stored.logical_shape);
    std::vector<float> got(want.size());
    decode_packed_rows(*view, cols, 0, rows, got.data());
    ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << v.name << ": " << name;
    ++views;
  }
  std::printf("%s: %d packed views decode to dequantize's bits\n", v.name.c_str(), views);
  EXPECT_GE(views, 40) << v.name;  // 4 layers x 8 experts x 3 at least

  const Numerics f32{cpu::KvStorage::F32, cpu::IndexerStorage::F32};
  const Model decoded = Model::load(q, f32, WeightLoad::DecodeAll), packed = Model::load(q, f32, WeightLoad::KeepLinearsPacked);
  const std::vector<int32_t> prompt = dsv4::testing::quant_test_prompt();
  SequenceState sd = decoded.new_sequence(int(prompt.size()) + 8), sp = packed.new_sequence(int(prompt.size()) + 8);
  std::vector<float> ld = decoded.forward(sd, prompt, false), lp = packed.forward(sp, prompt, false);
  const int V = decoded.config().vocab_size;
  for (int step = 0; step < 6; ++step) {
    const float* last = ld.data() + ld.size() - size_t(V);
    const int32_t next = int32_t(std::max_element(last, last + V) - last);
    const float* last_packed = lp.data() + lp.size() - size_t(V);
    EXPECT_EQ(std::max_element(last_packed, last_packed + V) - last_packed, next) << v.name << " step " << step;
    const std::vector<int32_t> one{next};
    const std::vector<float> rd = decoded.forward(sd, one, true), rp = packed.forward(sp, one, true);
    ld.insert(ld.end(), rd.begin(), rd.end());
    lp.insert(lp.end(), rp.begin(), rp.end());
  }
  double largest = 0;
  for (float x : ld) largest = std::max(largest, std::fabs(double(x)));
  const double d = max_abs_diff(ld, lp);
  std::printf("%s: CPU on packed weights vs decoded fp32: max |logit diff| %.3g of max |logit| %.3g\n",
              v.name.c_str(), d, largest);
  EXPECT_GT(largest, 0.1);
  EXPECT_LE(d, 1e-5 * largest) << v.name;
}

TEST(QuantE2E, CpuPackedWeightsNvfp4) { check_packed_cpu(kNvfp4All); }
TEST(QuantE2E, CpuPackedWeightsDeepSeekFp8Fp4) { check_packed_cpu(kDeepSeek); }

// `dsv4 generate --cpu-weights packed` gives the tokens of --cpu-weights fp32; a model holding shapes only is refused.
TEST(QuantE2E, CliCpuWeightsPacked) {
  const std::string q = quantised(kDeepSeek, source_dir());
  std::string out[2];
  for (int i = 0; i < 2; ++i) {
    const std::string mode = i ? "packed" : "fp32";
    const fs::path log = work_dir() / ("cpu-weights-" + mode + ".log");
    const int rc = run_cli("generate --model " + q + " --prompt-ids 5,17,99,42 --max-new-tokens 8 --ignore-eos --json "
                           "--kv-dtype f32 --indexer-dtype f32 --cpu-weights " + mode, log);
    out[i] = slurp(log);
    ASSERT_EQ(rc, 0) << out[i];
  }
  const auto ids = [](const std::string& text) {
    const size_t at = text.find("\"output_ids\"");
    return at == std::string::npos ? std::string() : text.substr(at, text.find(']', at) - at);
  };
  EXPECT_FALSE(ids(out[0]).empty()) << out[0];
  EXPECT_EQ(ids(out[0]), ids(out[1]));
  const ModelConfig c = ModelConfig::from_model_dir(q);
  const Model shapes(c, synthetic_weights(c, 1, SyntheticLinears::ShapeOnly), Numerics{});
  SequenceState state = shapes.new_sequence(8);
  EXPECT_THROW(shapes.forward(state, std::vector<int32_t>{1, 2}, true), Error);
}

// The golden tiny-flash checkpoint (tests/data/golden, committed by the reference work) through the same path.
TEST(QuantE2E, GoldenTinyFlashNvfp4MatchesDequantised) {
  const fs::path golden = fs::path(DSV4_TEST_DATA) / "golden" / "tiny-flash";
  if (!fs::exists(golden / "config.json")) GTEST_SKIP() << "no " << golden;
  check_variant({"golden-nvfp4", "--format nvfp4 --all-linears", WeightFormat::Nvfp4, WeightFormat::Nvfp4},
                golden.string());
}

// Official FP8 + FP4 in, NVFP4 experts out (what NVIDIA's DeepSeek-V4 NVFP4 checkpoints are): FP8 linears copied
// with their e8m0 scales, the config keeps quant_method fp8 and routes experts to NVFP4.
TEST(QuantE2E, OfficialToNvfp4KeepsFp8Linears) {
  const std::string official = quantised(kDeepSeek, source_dir());
  const Variant v{"official-to-nvfp4", "--format nvfp4", WeightFormat::Nvfp4, WeightFormat::Fp8Block};
  check_variant(v, official);
  std::ifstream in(fs::path(quantised(v, official)) / "config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  const nlohmann::json& qc = config.at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "fp8");
  EXPECT_EQ(qc.at("moe_quant_algo"), "NVFP4");
  EXPECT_EQ(qc.at("scale_fmt"), "ue8m0");
}

TEST(QuantE2E, Nvfp4ConfigAndCompanionNames) {
  const fs::path q = quantised(kNvfp4, source_dir());
  std::ifstream in(q / "config.json");
  const nlohmann::json config = nlohmann::json::parse(in);
  const nlohmann::json& qc = config.at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "modelopt");
  EXPECT_EQ(qc.at("quant_algo"), "NVFP4");
  EXPECT_EQ(qc.at("group_size"), 16);
  std::ifstream hin(q / "hf_quant_config.json");
  const nlohmann::json hf = nlohmann::json::parse(hin);
  EXPECT_EQ(hf.at("producer").at("name"), "modelopt");
  EXPECT_EQ(hf.at("quantization").at("quant_algo"), "NVFP4");

  const Checkpoint c = Checkpoint::open(q.string());
  const Checkpoint src = Checkpoint::open(source_dir());
  for (const auto& [name, t] : src.tensors()) {
    ASSERT_NE(c.find(name), nullptr) << "input name kept: " << name;
    if (name.find("ffn.experts.") != std::string::npos && name.find("shared") == std::string::npos) {
      const std::string p = name.substr(0, name.size() - 6);
      const TensorView* w = c.find(name);
      const TensorView* s = c.find(p + "weight_scale");
      const TensorView* s2 = c.find(p + "weight_scale_2");
      ASSERT_TRUE(w && s && s2) << name;
      EXPECT_EQ(w->dtype, DType::U8);
      EXPECT_EQ(w->shape, (std::vector<int64_t>{t->shape[0], t->shape[1] / 2}));
      EXPECT_EQ(s->dtype, DType::F8_E4M3);
      EXPECT_EQ(s->shape, (std::vector<int64_t>{t->shape[0], t->shape[1] / 16}));
      EXPECT_EQ(s2->dtype, DType::F32);
      EXPECT_TRUE(s2->shape.empty());
    } else {
      // unquantised tensors are copied byte for byte
      const TensorView* o = c.find(name);
      ASSERT_EQ(o->dtype, t->dtype) << name;
      ASSERT_EQ(o->nbytes, t->nbytes) << name;
      EXPECT_EQ(std::memcmp(o->data, t->data, t->nbytes), 0) << name;
    }
  }
  // w1 and w3 of one expert share weight_scale_2 (ModelOpt unifies linears that share an input).
  for (const char* prefix : {"model.layers.3.ffn.experts.5.", "layers.3.ffn.experts.5."}) {
    const TensorView* a = c.find(std::string(prefix) + "w1.weight_scale_2");
    const TensorView* b = c.find(std::string(prefix) + "w3.weight_scale_2");
    if (!a) continue;
    ASSERT_TRUE(b);
    EXPECT_EQ(std::memcmp(a->data, b->data, 4), 0);
  }
}

TEST(QuantE2E, InspectReportsFormatsAndBytes) {
  const std::string q = quantised(kNvfp4, source_dir());
  const fs::path log = work_dir() / "inspect.log";
  ASSERT_EQ(run_cli("inspect --model " + q, log), 0) << slurp(log);
  const std::string text = slurp(log);
  EXPECT_NE(text.find("routed experts"), std::string::npos) << text;
  EXPECT_NE(text.find("nvfp4"), std::string::npos) << text;
  EXPECT_NE(text.find("bytes read per decoded token"), std::string::npos) << text;

  const InspectReport r = inspect_checkpoint(q);
  const ModelConfig config = ModelConfig::from_model_dir(q);
  int64_t expert_params = 0, expert_tensors = 0;
  uint64_t expert_bytes = 0, expert_per_token = 0;
  for (const InspectRow& row : r.rows)
    if (row.group == TensorGroup::RoutedExperts) {
      EXPECT_EQ(row.format, "nvfp4");
      expert_params += row.params;
      expert_tensors += row.tensors;
      expert_bytes += row.bytes;
      expert_per_token += row.bytes_per_token;
    }
  const int64_t per_expert = 3 * int64_t(config.moe_inter) * config.hidden_size;
  EXPECT_EQ(expert_tensors, 3 * config.n_layers * config.n_routed_experts);
  EXPECT_EQ(expert_params, per_expert * config.n_layers * config.n_routed_experts);
  // packed codes (1/2 byte) + e4m3 scale per 16 (1/16 byte) + 4-byte weight_scale_2 per tensor
  EXPECT_EQ(expert_bytes, uint64_t(expert_params / 2 + expert_params / 16 + 4 * expert_tensors));
  EXPECT_NEAR(double(expert_per_token), double(expert_bytes) * config.n_experts_per_tok / config.n_routed_experts,
              double(expert_tensors));
  EXPECT_EQ(r.bytes, Checkpoint::open(q).total_bytes());
  // Memory to run it: fp32 everything on the CPU; packed, only the NVFP4 experts stay as stored (the attention
  // linears are F32 here, which have no packed form).
  EXPECT_EQ(r.cpu_fp32_bytes, uint64_t(r.params) * 4);
  EXPECT_EQ(r.cpu_fp32_bytes - r.cpu_packed_bytes, uint64_t(expert_params) * 4 - expert_bytes);
  EXPECT_NE(text.find("--cpu-weights packed"), std::string::npos) << text;
  EXPECT_NE(text.find("H200 x 1 (one GPU)"), std::string::npos) << text;
}

// Writes the dequantised checkpoints for reference/quant/transformers_logits.py when asked:
// DSV4_QUANT_EXPORT_DIR=/path ./dsv4_tests --gtest_filter=QuantE2E.Export* (generated source only).
TEST(QuantE2E, ExportDequantisedForTransformers) {
  const char* out = std::getenv("DSV4_QUANT_EXPORT_DIR");
  if (!out) GTEST_SKIP() << "set DSV4_QUANT_EXPORT_DIR to export";
  for (const Variant& v : {kNvfp4, kNvfp4All, kDeepSeek}) {
    const fs::path d = fs::path(out) / v.name;
    dsv4::testing::write_dequantised_checkpoint(quantised(v, source_dir()), d.string());
    const std::vector<float> a = logits_of(d.string());
    write_npy_f32((fs::path(out) / (v.name + "-engine.npy")).string(), a.data(),
                  {int64_t(dsv4::testing::quant_test_prompt().size()), int64_t(a.size() / dsv4::testing::quant_test_prompt().size())});
  }
}

// A malformed input (an FP8 expert without its scale, a packed expert with odd K) stops `dsv4 quantize` with exit 1
// and a message naming the tensor; nothing half-written is reported as success.
TEST(QuantE2E, QuantizeRejectsMalformedInput) {
  const fs::path in = work_dir() / "malformed";
  fs::create_directories(in);
  std::ofstream(in / "config.json") << "{\"model_type\": \"deepseek_v4\"}\n";
  const std::vector<uint8_t> codes(16 * 32, 0x38);
  write_safetensors((in / "model.safetensors").string(),
                    {{"layers.0.ffn.experts.3.w2.weight", DType::F8_E4M3, {16, 32}, codes}});
  const fs::path log = work_dir() / "malformed.log";
  EXPECT_NE(run_cli("quantize --model " + in.string() + " --out " + (work_dir() / "malformed-out").string(), log), 0);
  const std::string text = slurp(log);
  EXPECT_NE(text.find("layers.0.ffn.experts.3.w2.weight"), std::string::npos) << text;
  EXPECT_NE(text.find("without a scale"), std::string::npos) << text;
}
