// SPDX-License-Identifier: MIT
// The synthetic models behind `dsv4 bench`: the Flash-shaped config is the official Flash config (spec 1.1 / 1.2)
// up to the routed-expert count; synthetic weights have every shape load_weights would give, empty data exactly
// for the linear layers, valid router tables, and are deterministic per seed. Also the bench command's checks
// and its byte accounting (--plan-only), which need no GPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "run_cli.h"
#include "core/check.h"
#include "model/model.h"
#include "model/runner.h"
#include "model/synthetic.h"

using namespace dsv4;
using ::testing::HasSubstr;

namespace {

// The official V4-Flash inference config (legacy keys, spec section 1), with n_routed_experts replaced.
nlohmann::json official_flash(int n_routed_experts) {
  nlohmann::json ratios = nlohmann::json::array({0, 0});
  for (int i = 0; i < 20; ++i) ratios.push_back(4), ratios.push_back(128);
  ratios.push_back(4);
  ratios.push_back(0);  // MTP block
  return {{"vocab_size", 129280}, {"hidden_size", 4096}, {"num_hidden_layers", 43}, {"num_attention_heads", 64},
          {"num_key_value_heads", 1}, {"head_dim", 512}, {"qk_rope_head_dim", 64}, {"q_lora_rank", 1024},
          {"o_groups", 8}, {"o_lora_rank", 1024}, {"sliding_window", 128}, {"compress_ratios", ratios},
          {"index_n_heads", 64}, {"index_head_dim", 128}, {"index_topk", 512}, {"n_routed_experts", n_routed_experts},
          {"n_shared_experts", 1}, {"num_experts_per_tok", 6}, {"moe_intermediate_size", 2048},
          {"num_hash_layers", 3}, {"scoring_func", "sqrtsoftplus"}, {"norm_topk_prob", true},
          {"routed_scaling_factor", 1.5}, {"swiglu_limit", 10.0}, {"hc_mult", 4}, {"hc_sinkhorn_iters", 20},
          {"hc_eps", 1e-6}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000}, {"compress_rope_theta", 160000},
          {"rope_scaling", {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536},
                            {"beta_fast", 32}, {"beta_slow", 1}}},
          {"max_position_embeddings", 1048576}, {"bos_token_id", 0}, {"eos_token_id", 1}};
}

void expect_same_rope(const RopeConfig& a, const RopeConfig& b) {
  EXPECT_EQ(a.theta, b.theta);
  EXPECT_EQ(a.yarn, b.yarn);
  EXPECT_EQ(a.factor, b.factor);
  EXPECT_EQ(a.original_max_position, b.original_max_position);
  EXPECT_EQ(a.beta_fast, b.beta_fast);
  EXPECT_EQ(a.beta_slow, b.beta_slow);
}

bool shape_only(const Matrix& m, int rows, int cols) { return m.rows == rows && m.cols == cols && m.data.empty(); }
bool filled(const Matrix& m, int rows, int cols) {
  return m.rows == rows && m.cols == cols && m.data.size() == size_t(rows) * cols;
}

// Every float the weights carry, in a fixed order (for determinism checks).
std::vector<float> all_values(const ModelWeights& w) {
  std::vector<float> v;
  auto add = [&v](const std::vector<float>& x) { v.insert(v.end(), x.begin(), x.end()); };
  add(w.norm), add(w.hc_head.fn.data), add(w.hc_head.base), add(w.hc_head.scale);
  for (const LayerWeights& L : w.layers) {
    add(L.attn_norm), add(L.ffn_norm), add(L.hc_attn.fn.data), add(L.hc_ffn.fn.data), add(L.hc_ffn.scale);
    add(L.attn.q_norm), add(L.attn.sink), add(L.ffn.gate.data), add(L.ffn.gate_bias);
    if (L.attn.compressor) add(L.attn.compressor->ape.data);
    if (L.attn.indexer) add(L.attn.indexer->weights_proj.data);
    for (int32_t id : L.ffn.tid2eid) v.push_back(float(id));
  }
  return v;
}

using dsv4::testing::RunResult;
using dsv4::testing::run_dsv4;

}  // namespace

TEST(Synthetic, FlashConfigIsTheOfficialOneWithFewerExperts) {
  const ModelConfig c = flash_shaped_config(32);
  const ModelConfig ref = ModelConfig::from_json(official_flash(32));
  EXPECT_EQ(c.summary(), ref.summary());
  EXPECT_EQ(c.attn_kind, ref.attn_kind);
  EXPECT_EQ(c.compress_ratio, ref.compress_ratio);
  EXPECT_EQ(c.hash_routed, ref.hash_routed);
  EXPECT_EQ(c.scoring, ScoringFunc::SqrtSoftplus);
  EXPECT_EQ(c.norm_topk_prob, ref.norm_topk_prob);
  EXPECT_EQ(c.routed_scaling_factor, 1.5f);
  EXPECT_EQ(c.swiglu_limit, 10.0f);
  EXPECT_EQ(c.hc_eps, ref.hc_eps);
  EXPECT_EQ(c.rms_norm_eps, ref.rms_norm_eps);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_EQ(c.eos_token_ids, std::vector<int>{1});
  expect_same_rope(c.rope_main, ref.rope_main);
  expect_same_rope(c.rope_compress, ref.rope_compress);
  EXPECT_TRUE(c.rope_compress.yarn);
  EXPECT_EQ(c.rope_compress.theta, 160000.0);
  EXPECT_EQ(c.rope_compress.original_max_position, 65536.0);

  int sliding = 0, csa = 0, hca = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    sliding += c.attn_kind[l] == AttnKind::Sliding;
    csa += c.attn_kind[l] == AttnKind::CSA;
    hca += c.attn_kind[l] == AttnKind::HCA;
  }
  EXPECT_EQ(c.n_layers, 43);
  EXPECT_EQ(sliding, 2);
  EXPECT_EQ(csa, 21);
  EXPECT_EQ(hca, 20);
  EXPECT_EQ(c.attn_kind[2], AttnKind::CSA);
  EXPECT_EQ(c.compress_ratio[3], 128);
  EXPECT_EQ(c.compress_ratio[42], 4);
  EXPECT_EQ(std::count(c.hash_routed.begin(), c.hash_routed.end(), true), 3);
  EXPECT_TRUE(c.hash_routed[0] && c.hash_routed[2] && !c.hash_routed[3]);
  EXPECT_EQ(flash_shaped_config(256).summary(), ModelConfig::from_json(official_flash(256)).summary());
}

TEST(Synthetic, FlashConfigNeedsSixExperts) {
  EXPECT_NO_THROW(flash_shaped_config(6));
  try {
    flash_shaped_config(5);
    FAIL() << "5 experts accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("at least 6"));
  }
}

TEST(Synthetic, SmallWeightsHaveLoaderShapesAndEmptyLinears) {
  const ModelConfig c = small_synthetic_config();
  ASSERT_EQ(c.n_layers, 5);
  const ModelWeights w = synthetic_weights(c, 7);
  const int D = 64, V = 300, H = 4, hd = 128, q_lora = 32, E = 8, I = 32, n_mix = 24;
  EXPECT_TRUE(shape_only(w.embed, V, D));
  EXPECT_TRUE(shape_only(w.head, V, D));
  EXPECT_EQ(w.norm.size(), size_t(D));
  EXPECT_TRUE(filled(w.hc_head.fn, 4, 4 * D));
  EXPECT_EQ(w.hc_head.base.size(), 4u);
  EXPECT_EQ(w.hc_head.scale.size(), 1u);
  ASSERT_EQ(w.layers.size(), 5u);
  for (int l = 0; l < c.n_layers; ++l) {
    SCOPED_TRACE(l);
    const LayerWeights& L = w.layers[l];
    EXPECT_EQ(L.attn_norm.size(), size_t(D));
    EXPECT_TRUE(filled(L.hc_attn.fn, n_mix, 4 * D));
    EXPECT_TRUE(filled(L.hc_ffn.fn, n_mix, 4 * D));
    EXPECT_EQ(L.hc_attn.base.size(), size_t(n_mix));
    EXPECT_EQ(L.hc_attn.scale.size(), 3u);
    const AttentionWeights& A = L.attn;
    EXPECT_TRUE(shape_only(A.wq_a, q_lora, D));
    EXPECT_TRUE(shape_only(A.wq_b, H * hd, q_lora));
    EXPECT_TRUE(shape_only(A.wkv, hd, D));
    EXPECT_TRUE(shape_only(A.wo_a, 2 * 16, H * hd / 2));
    EXPECT_TRUE(shape_only(A.wo_b, D, 2 * 16));
    EXPECT_EQ(A.q_norm.size(), size_t(q_lora));
    EXPECT_EQ(A.kv_norm.size(), size_t(hd));
    EXPECT_EQ(A.sink.size(), size_t(H));
    EXPECT_EQ(A.compressor.has_value(), l >= 2);
    EXPECT_EQ(A.indexer.has_value(), l == 2 || l == 4);
    if (A.compressor) {
      const int r = c.compress_ratio[l], width = (c.is_csa(l) ? 2 : 1) * hd;
      EXPECT_EQ(A.compressor->ratio, r);
      EXPECT_EQ(A.compressor->overlap, c.is_csa(l));
      EXPECT_TRUE(shape_only(A.compressor->wkv, width, D));
      EXPECT_TRUE(shape_only(A.compressor->wgate, width, D));
      EXPECT_TRUE(filled(A.compressor->ape, r, width));
      EXPECT_EQ(A.compressor->norm.size(), size_t(hd));
    }
    if (A.indexer) {
      EXPECT_TRUE(shape_only(A.indexer->wq_b, 2 * 64, q_lora));
      EXPECT_TRUE(filled(A.indexer->weights_proj, 2, D));
      EXPECT_TRUE(shape_only(A.indexer->compressor.wkv, 2 * 64, D));
      EXPECT_TRUE(filled(A.indexer->compressor.ape, 4, 2 * 64));
      EXPECT_EQ(A.indexer->compressor.norm.size(), 64u);
    }
    const MoEWeights& M = L.ffn;
    EXPECT_TRUE(filled(M.gate, E, D));
    ASSERT_EQ(M.experts.size(), size_t(E));
    for (const ExpertWeights& e : M.experts) {
      EXPECT_TRUE(shape_only(e.w1, I, D));
      EXPECT_TRUE(shape_only(e.w3, I, D));
      EXPECT_TRUE(shape_only(e.w2, D, I));
    }
    ASSERT_TRUE(M.shared.has_value());
    EXPECT_TRUE(shape_only(M.shared->w2, D, I));
    if (l < 3) {  // hash routed: tid2eid [vocab, 6], ids distinct within a row
      EXPECT_TRUE(M.gate_bias.empty());
      ASSERT_EQ(M.tid2eid.size(), size_t(V) * 6);
      for (int t = 0; t < V; ++t) {
        std::set<int32_t> row(M.tid2eid.begin() + t * 6, M.tid2eid.begin() + (t + 1) * 6);
        EXPECT_EQ(row.size(), 6u) << "token " << t;
        EXPECT_GE(*row.begin(), 0);
        EXPECT_LT(*row.rbegin(), E);
      }
    } else {
      EXPECT_TRUE(M.tid2eid.empty());
      EXPECT_EQ(M.gate_bias.size(), size_t(E));
    }
  }
  // O(1) scales: norms near 1, hc fn within 1/sqrt(4D), gate within 1/sqrt(D).
  for (float v : w.layers[0].attn_norm) EXPECT_TRUE(v >= 0.9f && v <= 1.1f) << v;
  for (float v : w.layers[1].hc_attn.fn.data) EXPECT_LE(std::abs(v), 1.0f / 16.0f);
  for (float v : w.layers[3].ffn.gate.data) EXPECT_LE(std::abs(v), 1.0f / 8.0f);
}

TEST(Synthetic, DeterministicPerSeed) {
  const ModelConfig c = small_synthetic_config();
  const std::vector<float> a = all_values(synthetic_weights(c, 11));
  EXPECT_GT(a.size(), 10000u);
  EXPECT_EQ(a, all_values(synthetic_weights(c, 11)));
  EXPECT_NE(a, all_values(synthetic_weights(c, 12)));
  const ModelWeights filled_a = synthetic_weights(c, 11, SyntheticLinears::Filled);
  EXPECT_EQ(filled_a.layers[4].ffn.experts[5].w2.data,
            synthetic_weights(c, 11, SyntheticLinears::Filled).layers[4].ffn.experts[5].w2.data);
  EXPECT_EQ(filled_a.embed.data.size(), size_t(300) * 64);
}

// With filled linears the small synthetic model runs on the CPU reference and stays finite and O(1) through
// compression (CSA ratio 4, HCA ratio 8) and hash routing: the scales the bench relies on on the GPU.
TEST(Synthetic, FilledSmallModelRunsOnTheCpuReference) {
  const ModelConfig c = small_synthetic_config();
  const Model model(c, synthetic_weights(c, 3, SyntheticLinears::Filled));
  const auto runner = make_cpu_runner(model, 64);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 40; ++i) prompt.push_back((i * 37 + 5) % c.vocab_size);
  const std::vector<float> logits = runner->forward(prompt, /*last_only=*/false);
  ASSERT_EQ(logits.size(), size_t(40) * c.vocab_size);
  double max_abs = 0, sum_sq = 0;
  for (float v : logits) {
    ASSERT_TRUE(std::isfinite(v));
    max_abs = std::max(max_abs, double(std::abs(v)));
    sum_sq += double(v) * v;
  }
  const double rms = std::sqrt(sum_sq / logits.size());
  EXPECT_GT(rms, 1e-3);
  EXPECT_LT(max_abs, 100.0);
  // The last rows differ from the first (the state moves the output).
  EXPECT_NE(std::vector<float>(logits.begin(), logits.begin() + c.vocab_size),
            std::vector<float>(logits.end() - c.vocab_size, logits.end()));
}

// With `mtp` the weights get an MTP block after the model's own, which keep their bits; the filled small model's
// block runs on the CPU reference on the main model's final streams and gives finite, O(1) logits.
TEST(Synthetic, MtpBlockComesAfterTheModelsWeights) {
  const ModelConfig c = small_synthetic_config();
  const ModelWeights with = synthetic_weights(c, 3, SyntheticLinears::Filled, true);
  const ModelWeights without = synthetic_weights(c, 3, SyntheticLinears::Filled);
  ASSERT_TRUE(with.mtp.has_value());
  EXPECT_FALSE(without.mtp.has_value());
  EXPECT_EQ(with.layers[4].ffn.experts[7].w3.data, without.layers[4].ffn.experts[7].w3.data);
  EXPECT_EQ(with.mtp->e_proj.rows, c.hidden_size);
  EXPECT_FALSE(with.mtp->block.attn.compressor.has_value());  // the block is sliding-window only
  const Model model(c, synthetic_weights(c, 3, SyntheticLinears::Filled, true));
  ASSERT_TRUE(model.has_mtp());
  std::vector<int32_t> ids;
  for (int i = 0; i < 20; ++i) ids.push_back((i * 41 + 3) % c.vocab_size);
  SequenceState state = model.new_sequence(64);
  std::vector<float> streams;
  model.forward(state, ids, true, &streams);
  const std::vector<float> logits =
      model.mtp_forward(state, streams.data(), std::span<const int32_t>(ids.data() + 1, ids.size() - 1), false);
  ASSERT_EQ(logits.size(), size_t(19) * c.vocab_size);
  double max_abs = 0;
  for (float v : logits) {
    ASSERT_TRUE(std::isfinite(v));
    max_abs = std::max(max_abs, double(std::abs(v)));
  }
  EXPECT_GT(max_abs, 1e-3);
  EXPECT_LT(max_abs, 100.0);
}

TEST(SyntheticBenchCli, RejectsTooFewExpertsBeforeAnyCudaCall) {
  const RunResult r = run_dsv4("bench --experts 3");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_THAT(r.out, HasSubstr("--experts must be >= 6"));
  const RunResult small = run_dsv4("bench --prefill 4096 --max-context 1000");
  EXPECT_EQ(small.exit_code, 1) << small.out;
  EXPECT_THAT(small.out, HasSubstr("--max-context 1000"));
}

// --switches: every set is checked before anything runs, and the report lists them.
TEST(SyntheticBenchCli, SwitchesAreCheckedAndReported) {
  const RunResult bad = run_dsv4("bench --plan-only --switches default,bulk+warp");
  EXPECT_EQ(bad.exit_code, 1) << bad.out;
  EXPECT_THAT(bad.out, HasSubstr("'bulk+warp' has 'warp'"));
  const std::filesystem::path json_path = std::filesystem::temp_directory_path() / "dsv4_bench_switches.json";
  const RunResult ok = run_dsv4("bench --plan-only --switches default,bulk+overlap+mhc+routing --json " +
                                json_path.string());
  ASSERT_EQ(ok.exit_code, 0) << ok.out;
  std::ifstream in(json_path);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["switches"], nlohmann::json({"default", "bulk+overlap+mhc+routing"}));
  std::filesystem::remove(json_path);
}

#ifdef DSV4_HAVE_CUDA
// --plan-only --gpus prints the layer split and what each GPU's pre-upload check asks (host arithmetic, no GPU): the
// real Flash over two H200s, each stage with its own chunk workspaces.
TEST(SyntheticBenchCli, PlanOnlySplitsFlashOverTwoGpusWithTheirWorkspaces) {
  const std::filesystem::path json_path = std::filesystem::temp_directory_path() / "dsv4_bench_plan_gpus.json";
  const RunResult r = run_dsv4("bench --plan-only --experts 256 --format nvfp4 --gpus 0,1 --prefill 8192 "
                               "--prefill-chunk 2048 --json " + json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("workspaces"));
  std::ifstream in(json_path);
  const nlohmann::json j = nlohmann::json::parse(in);
  const nlohmann::json& stages = j["stages"]["nvfp4"];
  ASSERT_EQ(stages.size(), 2u);
  double weights = 0;
  for (const auto& s : stages) {
    EXPECT_EQ(s["prefill_chunk"].get<int>(), 2048);
    // Per token of a chunk at least 7 pairs x (2048 x 10 + 4096 x 4) bytes: ~0.5 GB at 2048 tokens.
    EXPECT_GT(s["workspace_bytes"].get<double>(), 0.5e9);
    EXPECT_LT(s["workspace_bytes"].get<double>(), 2e9);
    EXPECT_GT(s["state_bytes_per_sequence"].get<double>(), 0);
    const double need = s["weight_bytes"].get<double>() + s["workspace_bytes"].get<double>() +
                        s["state_bytes_per_sequence"].get<double>();
    EXPECT_LT(need, 139.0 * (1 << 30));  // fits an H200's free memory
    weights += s["weight_bytes"].get<double>();
  }
  EXPECT_EQ(stages[0]["workspace_bytes"], stages[1]["workspace_bytes"]);
  EXPECT_EQ(stages[0]["layer_begin"].get<int>(), 0);
  EXPECT_EQ(stages[1]["layer_end"].get<int>(), 43);
  EXPECT_NEAR(weights / 1e9, 161.8, 1.0);  // 150.7 GiB, and the MTP-free split adds no table
  std::filesystem::remove(json_path);
}
#endif

// --plan-only prints the accounting without a GPU; the JSON's numbers against an independent count.
TEST(SyntheticBenchCli, PlanOnlyAccountsTheFlashBytesPerToken) {
  const std::filesystem::path json_path = std::filesystem::temp_directory_path() / "dsv4_bench_plan.json";
  const RunResult r = run_dsv4("bench --plan-only --experts 32 --prefill 1024 --decode-context 8192 "
                               "--decode-steps 64 --json " + json_path.string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("routed experts (6 of 32)"));
  std::ifstream in(json_path);
  const nlohmann::json j = nlohmann::json::parse(in);
  const double expert = 3.0 * 2048 * 4096 * 43;  // one expert's elements over all layers
  for (const auto& [name, bytes_per_element] : {std::pair{"nvfp4", 0.5625}, std::pair{"bf16", 2.0}}) {
    SCOPED_TRACE(name);
    const nlohmann::json& f = j["formats"][name];
    EXPECT_EQ(f["decode_position"].get<int64_t>(), 8192 + 2 + 32);
    std::map<std::string, double> bytes;
    double sum = 0;
    for (const auto& line : f["decode_components"]) {
      bytes[line["component"].get<std::string>()] = line["bytes"].get<double>();
      sum += line["bytes"].get<double>();
    }
    EXPECT_DOUBLE_EQ(bytes["routed experts (6 of 32)"], 6 * expert * bytes_per_element);
    EXPECT_DOUBLE_EQ(bytes["shared expert"], expert * bytes_per_element);
    EXPECT_DOUBLE_EQ(bytes["lm_head (bf16)"], 129280.0 * 4096 * 2);
    // Spec 9: attention linears 4.599 B params (3.156 + 1.443).
    EXPECT_NEAR(bytes["attention wq_a wq_b wkv wo_a wo_b"] / bytes_per_element, 4.599e9, 1e6);
    // KV at position 8226, fp32: 43 layers x 128 window entries, 21 CSA layers x 512 selected + 20 HCA layers x
    // 64 entries of 512 floats; 21 x 2056 indexer keys of 128 floats.
    EXPECT_DOUBLE_EQ(bytes["KV window entries (fp32)"], 43.0 * 128 * 512 * 4);
    EXPECT_DOUBLE_EQ(bytes["KV CSA top-k entries (fp32)"], 21.0 * 512 * 512 * 4);
    EXPECT_DOUBLE_EQ(bytes["KV HCA entries (fp32)"], 20.0 * 64 * 512 * 4);
    EXPECT_DOUBLE_EQ(bytes["indexer keys (fp32)"], 21.0 * 2056 * 128 * 4);
    EXPECT_DOUBLE_EQ(f["decode_bytes_per_token"].get<double>(), sum);
    // Spec 9 Flash decode FLOPs: 26.5 GFLOP of weights (head counted) + 3.0 attention at 8K.
    EXPECT_NEAR(f["decode_flops_per_token"].get<double>() / 1e9, 29.5, 0.1);
    const double prefill_flops = f["prefill"][0]["flops_per_token"].get<double>();
    EXPECT_GT(prefill_flops, 25e9);
    EXPECT_LT(prefill_flops, 27e9);
  }
  EXPECT_NEAR(j["formats"]["nvfp4"]["decode_bytes_per_token"].get<double>() / 1e9, 8.42, 0.01);
  std::filesystem::remove(json_path);
}
