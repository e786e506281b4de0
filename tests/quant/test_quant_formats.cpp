// SPDX-License-Identifier: MIT
// Quantised weight formats: exact decodes of hand-made blocks (FP8 128x128 with e8m0 / f32 scales, per-tensor FP8,
// DeepSeek FP4 with e8m0 per 32, ModelOpt NVFP4 incl. grouped-expert layouts), quantise -> dequantise error
// bounds per block, ModelOpt's tie rules, and malformed tensors rejected with messages naming the tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "core/check.h"
#include "formats/blocks.h"
#include "formats/nvfp4.h"
#include "io/safetensors.h"
#include "model/weight_decode.h"
#include "quant/quantize.h"
#include "quant/stored_weight.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

struct T {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

class QuantFormats : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dsv4_quant_formats_" + std::to_string(getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  const Checkpoint& write(const std::vector<T>& tensors) {
    std::vector<TensorToWrite> views;
    for (const T& t : tensors) views.push_back({t.name, t.dtype, t.shape, t.bytes});
    write_safetensors((dir_ / "model.safetensors").string(), views);
    ckpt_ = std::make_unique<Checkpoint>(Checkpoint::open(dir_.string()));
    return *ckpt_;
  }
  std::vector<float> decode(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorView* t = ckpt_->find(name);
    EXPECT_NE(t, nullptr) << name;
    return decode_weight_f32(*ckpt_, *t, shape);
  }
  // The dsv4::Error message of decoding `name`, or "" when it did not throw.
  std::string decode_error(const std::string& name, const std::vector<int64_t>& shape) {
    try {
      decode(name, shape);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
  std::unique_ptr<Checkpoint> ckpt_;
};

// Random e4m3 bytes without the NaN codes.
std::vector<uint8_t> random_e4m3(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) {
    do b = uint8_t(gen()); while ((b & 0x7f) == 0x7f);
  }
  return v;
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t(gen());
  return v;
}

}  // namespace

TEST_F(QuantFormats, Fp8BlockE8m0ExactWithRaggedTiles) {
  const int O = 130, I = 200;  // 2 x 2 tiles, the last ones partial
  const std::vector<uint8_t> codes = random_e4m3(size_t(O) * I, 1);
  const std::vector<uint8_t> scale = {120, 127, 131, 100};
  write({{"layers.0.attn.wq_a.weight", DType::F8_E4M3, {O, I}, codes},
         {"layers.0.attn.wq_a.scale", DType::F8_E8M0, {2, 2}, scale}});
  const std::vector<float> w = decode("layers.0.attn.wq_a.weight", {O, I});
  for (int o = 0; o < O; ++o)
    for (int i = 0; i < I; ++i) {
      const float want = e4m3_to_f32(codes[size_t(o) * I + i]) * std::ldexp(1.0f, scale[(o / 128) * 2 + i / 128] - 127);
      ASSERT_EQ(w[size_t(o) * I + i], want) << o << "," << i;
    }
}

TEST_F(QuantFormats, Fp8BlockF32ScalesAndHfName) {
  const int O = 64, I = 256;  // 1 x 2 tiles
  const std::vector<uint8_t> codes = random_e4m3(size_t(O) * I, 2);
  write({{"model.layers.0.self_attn.q_a_proj.weight", DType::F8_E4M3, {O, I}, codes},
         {"model.layers.0.self_attn.q_a_proj.weight_scale_inv", DType::F32, {1, 2}, f32_bytes({0.375f, 3.0e-3f})}});
  const std::vector<float> w = decode("model.layers.0.self_attn.q_a_proj.weight", {O, I});
  for (int o = 0; o < O; ++o)
    for (int i = 0; i < I; ++i)
      ASSERT_EQ(w[size_t(o) * I + i], e4m3_to_f32(codes[size_t(o) * I + i]) * (i < 128 ? 0.375f : 3.0e-3f));
}

TEST_F(QuantFormats, Fp8PerTensorAndPerExpertScale) {
  const std::vector<uint8_t> codes = random_e4m3(2 * 4 * 8, 3);
  write({{"q.weight", DType::F8_E4M3, {4, 16}, std::vector<uint8_t>(codes.begin(), codes.begin() + 64)},
         {"q.weight_scale", DType::F32, {}, f32_bytes({0.5f})},
         {"mlp.experts.down_proj", DType::F8_E4M3, {2, 4, 8}, codes},
         {"mlp.experts.down_proj_scale_inv", DType::F32, {2, 1, 1}, f32_bytes({2.0f, 0.25f})}});
  const std::vector<float> q = decode("q.weight", {4, 16});
  for (int k = 0; k < 64; ++k) ASSERT_EQ(q[k], e4m3_to_f32(codes[k]) * 0.5f);
  const std::vector<float> d = decode("mlp.experts.down_proj", {2, 4, 8});
  for (int k = 0; k < 64; ++k) ASSERT_EQ(d[k], e4m3_to_f32(codes[k]) * (k < 32 ? 2.0f : 0.25f));
}

TEST_F(QuantFormats, DeepSeekFp4ExactAndNibbleOrder) {
  const int O = 3, I = 96;  // 3 groups of 32 per row
  std::vector<uint8_t> packed = random_bytes(size_t(O) * I / 2, 4);
  packed[0] = 0x2b;  // element 0 = code 0xb (-1.5), element 1 = code 0x2 (1.0)
  const std::vector<uint8_t> scale = {127, 128, 126, 120, 0, 140, 127, 127, 133};
  write({{"layers.1.ffn.experts.5.w1.weight", DType::I8, {O, I / 2}, packed},
         {"layers.1.ffn.experts.5.w1.scale", DType::F8_E8M0, {O, 3}, scale}});
  const std::vector<float> w = decode("layers.1.ffn.experts.5.w1.weight", {O, I});
  EXPECT_EQ(w[0], -1.5f);
  EXPECT_EQ(w[1], 1.0f);
  for (int o = 0; o < O; ++o)
    for (int i = 0; i < I; ++i) {
      const uint8_t byte = packed[size_t(o) * I / 2 + i / 2];
      const uint8_t code = (i % 2) ? byte >> 4 : byte & 0xf;
      ASSERT_EQ(w[size_t(o) * I + i], e2m1_to_f32(code) * e8m0_to_f32(scale[o * 3 + i / 32])) << o << "," << i;
    }
}

TEST_F(QuantFormats, Nvfp4ExactAndNibbleOrder) {
  const int O = 2, I = 32;
  std::vector<uint8_t> packed = random_bytes(O * I / 2, 5);
  packed[0] = 0x7c;  // element 0 = code 0xc (-2), element 1 = code 0x7 (6)
  const std::vector<uint8_t> scale = {f32_to_e4m3(1.5f), f32_to_e4m3(0.0078125f), f32_to_e4m3(448.0f),
                                      f32_to_e4m3(0.001953125f)};  // incl. the e4m3 subnormal 2^-9
  const float g = 3.0e-4f;
  write({{"layers.2.ffn.experts.0.w2.weight", DType::U8, {O, I / 2}, packed},
         {"layers.2.ffn.experts.0.w2.weight_scale", DType::F8_E4M3, {O, 2}, scale},
         {"layers.2.ffn.experts.0.w2.weight_scale_2", DType::F32, {}, f32_bytes({g})},
         {"layers.2.ffn.experts.0.w2.input_scale", DType::F32, {}, f32_bytes({123.0f})}});
  const std::vector<float> w = decode("layers.2.ffn.experts.0.w2.weight", {O, I});
  EXPECT_EQ(w[0], -2.0f * (1.5f * g));
  EXPECT_EQ(w[1], 6.0f * (1.5f * g));
  for (int o = 0; o < O; ++o)
    for (int i = 0; i < I; ++i) {
      const uint8_t byte = packed[size_t(o) * I / 2 + i / 2];
      const uint8_t code = (i % 2) ? byte >> 4 : byte & 0xf;
      ASSERT_EQ(w[size_t(o) * I + i], e2m1_to_f32(code) * (e4m3_to_f32(scale[o * 2 + i / 16]) * g));
    }
  // input_scale is recorded, never applied.
  const StoredWeight s = classify_weight(*ckpt_, *ckpt_->find("layers.2.ffn.experts.0.w2.weight"));
  EXPECT_EQ(s.format, WeightFormat::Nvfp4);
  ASSERT_NE(s.input_scale, nullptr);
}

TEST_F(QuantFormats, Nvfp4GroupedExpertsPerExpertGlobalAndFlattenedScale) {
  const int E = 2, O = 3, I = 16;
  const std::vector<uint8_t> packed = random_bytes(E * O * I / 2, 6);
  std::vector<uint8_t> scale;
  for (int k = 0; k < E * O; ++k) scale.push_back(f32_to_e4m3(0.5f + k));
  write({{"model.layers.0.mlp.experts.gate_up_proj", DType::U8, {E, O, I / 2}, packed},
         {"model.layers.0.mlp.experts.gate_up_proj_weight_scale", DType::F8_E4M3, {E * O, 1}, scale},
         {"model.layers.0.mlp.experts.gate_up_proj_weight_scale_2", DType::F32, {E}, f32_bytes({2.0f, 0.125f})}});
  const std::vector<float> w = decode("model.layers.0.mlp.experts.gate_up_proj", {E, O, I});
  for (int e = 0; e < E; ++e)
    for (int o = 0; o < O; ++o)
      for (int i = 0; i < I; ++i) {
        const size_t row = size_t(e) * O + o;
        const uint8_t byte = packed[row * I / 2 + i / 2];
        const uint8_t code = (i % 2) ? byte >> 4 : byte & 0xf;
        ASSERT_EQ(w[row * I + i], e2m1_to_f32(code) * (e4m3_to_f32(scale[row]) * (e == 0 ? 2.0f : 0.125f)));
      }
}

// ModelOpt's ties (NVFP4QTensor._cast_fp4): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
// 5 -> 4, > 6 saturates; sign from x < 0, so -0.0 -> code 0.
TEST(QuantNvfp4, ModelOptRoundingAndTies) {
  // global amax 2688 -> weight_scale_2 = 1; block amax 6 -> block scale e4m3(1) = 1; codes = e2m1(x) directly.
  const std::vector<float> x = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f,
                                -0.25f, -0.75f, -2.5f, -5.0f, -0.0f, 0.1f, -0.1f, 2.9f};
  const Nvfp4Matrix q = quantize_nvfp4(x, 1, 16, 2688.0f);
  EXPECT_EQ(q.global_scale, 1.0f);
  EXPECT_EQ(e4m3_to_f32(q.scale[0]), 1.0f);
  const uint8_t want[16] = {0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 12, 14, 0, 0, 8, 5};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(fp4_code_at(q.packed.data(), i), want[i]) << "x = " << x[i];
}

TEST(QuantNvfp4, RoundTripErrorBoundPerBlock) {
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  const int R = 64, C = 256;
  std::vector<float> w(size_t(R) * C);
  for (float& v : w) v = nd(gen);
  w[1234] = 0.9f;  // an outlier sets the global scale
  for (int k = 0; k < 16; ++k) w[size_t(5) * C + k] = 0.0f;  // an all-zero block
  const float amax = abs_max(w);
  const Nvfp4Matrix q = quantize_nvfp4(w, R, C, amax);
  EXPECT_EQ(q.global_scale, amax / 2688.0f);
  double worst_ratio = 0;
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < C / 16; ++b) {
      const float s = e4m3_to_f32(q.scale[size_t(r) * (C / 16) + b]);
      float block_amax = 0, block_err = 0;
      for (int k = 0; k < 16; ++k) {
        const size_t i = size_t(r) * C + b * 16 + k;
        const float deq = nvfp4_decode(fp4_code_at(q.packed.data() + size_t(r) * C / 2, b * 16 + k), s, q.global_scale);
        // nearest representable value of the block's grid (up to the fp32 rounding of x / (s*g))
        float best = INFINITY;
        for (uint8_t c = 0; c < 16; ++c) best = std::fmin(best, std::fabs(w[i] - nvfp4_decode(c, s, q.global_scale)));
        ASSERT_LE(std::fabs(w[i] - deq), best * (1 + 1e-5f) + 1e-12f) << r << "," << b << "," << k;
        block_amax = std::fmax(block_amax, std::fabs(w[i]));
        block_err = std::fmax(block_err, std::fabs(w[i] - deq));
      }
      // half the widest e2m1 step (1 of 2 in [4, 6]) times the block scale, which e4m3 rounds by <= 2^-4
      if (block_amax > 0) {
        ASSERT_LE(block_err, block_amax / 6.0f * (1.0f + 0.0625f) + 1e-7f) << r << "," << b;
        worst_ratio = std::fmax(worst_ratio, block_err / block_amax);
      } else {
        ASSERT_EQ(block_err, 0.0f);
      }
    }
  RecordProperty("nvfp4_worst_block_err_over_amax", std::to_string(worst_ratio));
  std::printf("NVFP4 worst per-block max|err| / block amax = %.4f (bound %.4f)\n", worst_ratio, 1.0625 / 6);
}

TEST(QuantFp8, RoundTripErrorBoundPerTile) {
  std::mt19937 gen(8);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int R = 200, C = 300;
  std::vector<float> w(size_t(R) * C);
  for (float& v : w) v = nd(gen) * 0.01f;
  w[7] = 3.0f;
  const Fp8BlockMatrix q = quantize_fp8_block(w, R, C);
  ASSERT_EQ(q.scale.size(), 6u);  // 2 x 3 tiles, ragged
  double worst_rel = 0;
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      const size_t i = size_t(r) * C + c;
      const float s = e8m0_to_f32(q.scale[(r / 128) * 3 + c / 128]);
      const float deq = e4m3_to_f32(q.codes[i]) * s;
      // 3 mantissa bits: half an ulp is <= 2^-4 relative; below 2^-6 (subnormal) the step is 2^-9 * s.
      ASSERT_LE(std::fabs(w[i] - deq), std::fmax(std::fabs(w[i]) * 0.0625f, 0.0009765625f * s)) << r << "," << c;
      if (std::fabs(w[i]) > 0.015625f * s) worst_rel = std::fmax(worst_rel, std::fabs(w[i] - deq) / std::fabs(w[i]));
    }
  // the scale is the smallest power of two that fits the tile: tile amax / s in (224, 448]
  for (int t = 0; t < 6; ++t) {
    float amax = 0;
    for (int r = (t / 3) * 128; r < std::min(R, (t / 3) * 128 + 128); ++r)
      for (int c = (t % 3) * 128; c < std::min(C, (t % 3) * 128 + 128); ++c) amax = std::fmax(amax, std::fabs(w[size_t(r) * C + c]));
    const float s = e8m0_to_f32(q.scale[t]);
    EXPECT_LE(amax / s, 448.0f);
    EXPECT_GT(amax / s, 224.0f);
  }
  std::printf("FP8 block worst relative error (normal range) = %.4f (bound 0.0625)\n", worst_rel);
}

TEST(QuantMxfp4, RoundTripErrorBoundPerGroup) {
  std::mt19937 gen(9);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  const int R = 16, C = 96;
  std::vector<float> w(size_t(R) * C);
  for (float& v : w) v = nd(gen);
  const Mxfp4Matrix q = quantize_mxfp4(w, R, C);
  double worst = 0;
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < C / 32; ++g) {
      const float s = e8m0_to_f32(q.scale[size_t(r) * 3 + g]);
      float amax = 0, err = 0;
      for (int k = 0; k < 32; ++k) {
        const size_t i = size_t(r) * C + g * 32 + k;
        const float deq = e2m1_to_f32(fp4_code_at(q.packed.data() + size_t(r) * C / 2, g * 32 + k)) * s;
        float best = INFINITY;
        for (uint8_t c = 0; c < 16; ++c) best = std::fmin(best, std::fabs(w[i] - e2m1_to_f32(c) * s));
        ASSERT_LE(std::fabs(w[i] - deq), best + 1e-12f);
        amax = std::fmax(amax, std::fabs(w[i]));
        err = std::fmax(err, std::fabs(w[i] - deq));
      }
      EXPECT_LE(amax / s, 6.0f);
      EXPECT_GT(amax / s, 3.0f);
      ASSERT_LE(err, s);  // half the widest step (2, between 4 and 6)
      worst = std::fmax(worst, err / amax);
    }
  std::printf("MXFP4 worst per-group max|err| / group amax = %.4f (bound 1/3)\n", worst);
}

// ---- malformed tensors: rejected with the tensor's name in the message ----

TEST_F(QuantFormats, RejectsWrongFp8ScaleShape) {
  write({{"layers.0.attn.wo_b.weight", DType::F8_E4M3, {130, 200}, random_e4m3(130 * 200, 10)},
         {"layers.0.attn.wo_b.scale", DType::F8_E8M0, {2, 3}, std::vector<uint8_t>(6, 127)}});
  const std::string msg = decode_error("layers.0.attn.wo_b.weight", {130, 200});
  EXPECT_NE(msg.find("layers.0.attn.wo_b.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 2]"), std::string::npos) << msg;
}

TEST_F(QuantFormats, RejectsNanE8m0Scale) {
  write({{"layers.0.attn.wkv.weight", DType::F8_E4M3, {4, 8}, random_e4m3(32, 11)},
         {"layers.0.attn.wkv.scale", DType::F8_E8M0, {1, 1}, {0xff}},
         {"layers.0.ffn.experts.1.w2.weight", DType::I8, {4, 16}, random_bytes(64, 12)},
         {"layers.0.ffn.experts.1.w2.scale", DType::F8_E8M0, {4, 1}, {127, 127, 0xff, 127}}});
  for (const char* name : {"layers.0.attn.wkv.weight", "layers.0.ffn.experts.1.w2.weight"}) {
    const std::string msg = decode_error(name, {4, std::string(name).find("experts") != std::string::npos ? 32 : 8});
    EXPECT_NE(msg.find(name), std::string::npos) << msg;
    EXPECT_NE(msg.find("0xFF"), std::string::npos) << msg;
  }
}

TEST_F(QuantFormats, RejectsNanNvfp4Scales) {
  write({{"a.weight", DType::U8, {2, 8}, random_bytes(16, 13)},
         {"a.weight_scale", DType::F8_E4M3, {2, 1}, {0x38, 0x7f}},
         {"a.weight_scale_2", DType::F32, {}, f32_bytes({1.0f})},
         {"b.weight", DType::U8, {2, 8}, random_bytes(16, 14)},
         {"b.weight_scale", DType::F8_E4M3, {2, 1}, {0x38, 0x38}},
         {"b.weight_scale_2", DType::F32, {}, f32_bytes({NAN})},
         {"c.weight", DType::U8, {2, 8}, random_bytes(16, 15)},
         {"c.weight_scale", DType::F8_E4M3, {2, 1}, {0x38, 0xb8}},  // -1.0
         {"c.weight_scale_2", DType::F32, {}, f32_bytes({1.0f})}});
  for (const char* name : {"a.weight", "b.weight", "c.weight"}) {
    const std::string msg = decode_error(name, {2, 16});
    EXPECT_NE(msg.find(std::string("\"") + name + "\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("finite and >= 0"), std::string::npos) << msg;
  }
}

TEST_F(QuantFormats, RejectsOddKAndShapeMismatch) {
  write({{"e.weight", DType::I8, {4, 8}, random_bytes(32, 16)},
         {"e.scale", DType::F8_E8M0, {4, 1}, std::vector<uint8_t>(4, 127)}});
  std::string msg = decode_error("e.weight", {4, 15});
  EXPECT_NE(msg.find("\"e.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("even K"), std::string::npos) << msg;
  msg = decode_error("e.weight", {4, 32});  // packed would be [4, 16]
  EXPECT_NE(msg.find("must be stored as [4, 16]"), std::string::npos) << msg;
  msg = decode_error("e.weight", {8, 16});
  EXPECT_NE(msg.find("\"e.weight\""), std::string::npos) << msg;
}

TEST_F(QuantFormats, RejectsMissingScales) {
  write({{"f8.weight", DType::F8_E4M3, {4, 8}, random_e4m3(32, 17)},
         {"fp4.weight", DType::I8, {4, 8}, random_bytes(32, 18)},
         {"nv.weight", DType::U8, {4, 8}, random_bytes(32, 19)},
         {"nv.weight_scale", DType::F8_E4M3, {4, 1}, std::vector<uint8_t>(4, 0x38)}});
  std::string msg = decode_error("f8.weight", {4, 8});
  EXPECT_NE(msg.find("\"f8.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("f8.scale"), std::string::npos) << msg;  // lists the names it tried
  msg = decode_error("fp4.weight", {4, 16});
  EXPECT_NE(msg.find("\"fp4.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("without a scale"), std::string::npos) << msg;
  msg = decode_error("nv.weight", {4, 16});
  EXPECT_NE(msg.find("\"nv.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("weight_scale_2"), std::string::npos) << msg;
}

TEST_F(QuantFormats, RejectsWrongFp4ScaleShapeAndDtype) {
  write({{"m.weight", DType::I8, {4, 32}, random_bytes(128, 20)},
         {"m.scale", DType::F8_E8M0, {4, 1}, std::vector<uint8_t>(4, 127)},   // needs [4, 2]
         {"n.weight", DType::U8, {4, 16}, random_bytes(64, 21)},
         {"n.weight_scale", DType::F8_E4M3, {4, 1}, std::vector<uint8_t>(4, 0x38)},  // needs [4, 2]
         {"n.weight_scale_2", DType::F32, {}, f32_bytes({1.0f})},
         {"p.weight", DType::I8, {4, 16}, random_bytes(64, 22)},
         {"p.scale", DType::BF16, {4, 1}, std::vector<uint8_t>(8, 0)}});
  std::string msg = decode_error("m.weight", {4, 64});
  EXPECT_NE(msg.find("\"m.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 2]"), std::string::npos) << msg;
  msg = decode_error("n.weight", {4, 32});
  EXPECT_NE(msg.find("\"n.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 2]"), std::string::npos) << msg;
  msg = decode_error("p.weight", {4, 32});
  EXPECT_NE(msg.find("\"p.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("BF16"), std::string::npos) << msg;
}

TEST_F(QuantFormats, RejectsNanFp8Codes) {
  std::vector<uint8_t> codes = random_e4m3(32, 23);
  codes[9] = 0xff;
  write({{"g.weight", DType::F8_E4M3, {4, 8}, codes}, {"g.scale", DType::F8_E8M0, {1, 1}, {127}}});
  const std::string msg = decode_error("g.weight", {4, 8});
  EXPECT_NE(msg.find("\"g.weight\""), std::string::npos) << msg;
  EXPECT_NE(msg.find("element 9"), std::string::npos) << msg;
}
