// SPDX-License-Identifier: MIT
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "core/check.h"
#include "model/config.h"
#include "model/model.h"

using namespace dsv4;
using nlohmann::json;
using ::testing::HasSubstr;

namespace {

// The official V4-Flash inference config (legacy keys), as listed in the spec, section 1.
json official_flash() {
  json ratios = json::array({0, 0});
  for (int i = 0; i < 20; ++i) ratios.push_back(4), ratios.push_back(128);
  ratios.push_back(4);
  ratios.push_back(0);  // MTP block
  return json{{"vocab_size", 129280}, {"hidden_size", 4096}, {"num_hidden_layers", 43},
              {"num_attention_heads", 64}, {"num_key_value_heads", 1}, {"head_dim", 512},
              {"qk_rope_head_dim", 64}, {"q_lora_rank", 1024}, {"o_groups", 8}, {"o_lora_rank", 1024},
              {"sliding_window", 128}, {"compress_ratios", ratios}, {"index_n_heads", 64},
              {"index_head_dim", 128}, {"index_topk", 512}, {"n_routed_experts", 256}, {"n_shared_experts", 1},
              {"num_experts_per_tok", 6}, {"moe_intermediate_size", 2048}, {"num_hash_layers", 3},
              {"scoring_func", "sqrtsoftplus"}, {"norm_topk_prob", true}, {"routed_scaling_factor", 1.5},
              {"swiglu_limit", 10.0}, {"hc_mult", 4}, {"hc_sinkhorn_iters", 20}, {"hc_eps", 1e-6},
              {"rms_norm_eps", 1e-6}, {"rope_theta", 10000}, {"compress_rope_theta", 160000},
              {"rope_scaling", {{"type", "yarn"}, {"factor", 16}, {"original_max_position_embeddings", 65536},
                                {"beta_fast", 32}, {"beta_slow", 1}}},
              {"max_position_embeddings", 1048576}, {"num_nextn_predict_layers", 1}, {"bos_token_id", 0},
              {"eos_token_id", 1}};
}

}  // namespace

TEST(Config, OfficialFlashLegacyKeys) {
  const ModelConfig c = ModelConfig::from_json(official_flash());
  EXPECT_EQ(c.n_layers, 43);
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.attn_kind[0], AttnKind::Sliding);
  EXPECT_EQ(c.attn_kind[1], AttnKind::Sliding);
  EXPECT_EQ(c.attn_kind[2], AttnKind::CSA);
  EXPECT_EQ(c.attn_kind[3], AttnKind::HCA);
  EXPECT_EQ(c.attn_kind[42], AttnKind::CSA);
  EXPECT_EQ(c.compress_ratio[3], 128);
  EXPECT_EQ(c.compress_ratio[42], 4);
  EXPECT_TRUE(c.hash_routed[2]);
  EXPECT_FALSE(c.hash_routed[3]);
  EXPECT_FALSE(c.rope_main.yarn);
  EXPECT_TRUE(c.rope_compress.yarn);
  EXPECT_DOUBLE_EQ(c.rope_compress.theta, 160000.0);
  EXPECT_DOUBLE_EQ(c.rope_compress.original_max_position, 65536.0);
  EXPECT_FLOAT_EQ(c.routed_scaling_factor, 1.5f);
  EXPECT_EQ(c.n_mtp_layers, 1);
}

TEST(Config, TransformersKeys) {
  json j = official_flash();
  j.erase("compress_ratios");
  j.erase("num_hash_layers");
  j.erase("qk_rope_head_dim");
  j.erase("rope_scaling");
  j["num_hidden_layers"] = 4;
  j["layer_types"] = {"heavily_compressed_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                      "sliding_attention"};
  j["compress_rates"] = {{"compressed_sparse_attention", 4}, {"heavily_compressed_attention", 16}};
  j["mlp_layer_types"] = {"hash_moe", "hash_moe", "moe", "moe"};
  j["partial_rotary_factor"] = 0.125;
  j["rope_parameters"] = {{"main", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                          {"compress", {{"rope_type", "yarn"}, {"rope_theta", 160000.0}, {"factor", 16.0},
                                        {"original_max_position_embeddings", 65536}, {"beta_fast", 32.0},
                                        {"beta_slow", 1.0}, {"attention_factor", 1.0}}}};
  const ModelConfig c = ModelConfig::from_json(j);
  EXPECT_EQ(c.rope_dim, 64);
  EXPECT_EQ(c.attn_kind[0], AttnKind::HCA);
  EXPECT_EQ(c.compress_ratio[0], 16);
  EXPECT_EQ(c.compress_ratio[2], 4);
  EXPECT_EQ(c.attn_kind[3], AttnKind::Sliding);
  EXPECT_EQ(c.compress_ratio[3], 0);
  EXPECT_TRUE(c.hash_routed[1]);
  EXPECT_FALSE(c.hash_routed[2]);
  EXPECT_TRUE(c.rope_compress.yarn);
}

TEST(Config, RejectsBadInputNamingTheField) {
  auto error_of = [](const json& j) {
    try {
      ModelConfig::from_json(j);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  json j = official_flash();
  j.erase("hidden_size");
  EXPECT_THAT(error_of(j), HasSubstr("hidden_size"));
  j = official_flash();
  j["hidden_size"] = "big";
  EXPECT_THAT(error_of(j), HasSubstr("hidden_size"));
  j = official_flash();
  j["num_key_value_heads"] = 8;
  EXPECT_THAT(error_of(j), HasSubstr("num_key_value_heads"));
  j = official_flash();
  j["compress_ratios"] = json::array({0, 4});
  EXPECT_THAT(error_of(j), HasSubstr("compress_ratios"));
  j = official_flash();
  j["scoring_func"] = "relu";
  EXPECT_THAT(error_of(j), HasSubstr("scoring_func"));
  j = official_flash();
  j["num_attention_heads"] = 60;  // not a multiple of o_groups 8
  EXPECT_THAT(error_of(j), HasSubstr("o_groups"));
}

// Spec 3.1 worked numbers for V4-Flash: theta 160000, YaRN 16 over 65536 -> pairs i <= 15 unchanged, i >= 25
// divided by 16, linear ramp between.
TEST(Rope, YarnRampMatchesSpec) {
  const ModelConfig c = ModelConfig::from_json(official_flash());
  const std::vector<float> plain = rope_inv_freq(c.rope_main, 64);
  const std::vector<float> yarn = rope_inv_freq(c.rope_compress, 64);
  ASSERT_EQ(yarn.size(), 32u);
  EXPECT_FLOAT_EQ(plain[1], std::pow(10000.0f, -2.0f / 64));
  for (int i = 0; i < 32; ++i) {
    const double f = std::pow(160000.0, -2.0 * i / 64);
    const double ramp = std::clamp((i - 15.0) / (25.0 - 15.0), 0.0, 1.0);
    EXPECT_NEAR(yarn[i], f * (1 - ramp) + f / 16 * ramp, 1e-6 * f) << "pair " << i;
  }
}
