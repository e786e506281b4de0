// SPDX-License-Identifier: MIT
// gpu::attention against an fp64 reference of ops.h's contract: window keys from this chunk and from the ring,
// compressed entries (the indexer's picks or all of them), the sink in the denominator, inverse RoPE on the
// output, the grouped bf16 layout. Few rows x heads take the per-head kernel, many (>= 512) the head-group kernel;
// both split the keys over blocks (partials + merge) when their blocks do not fill the GPU. The output is poisoned
// first, so an unwritten element fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/ops.h"
#include "cuda_test_util.h"
#include "fmt/format.h"
#include "formats/bf16.h"
#include "model/model.h"

namespace dsv4 {
namespace {

using namespace cuda_test;

struct AttnCase {
  std::string name;
  int n, heads, groups, dim, rope_dim, window, ratio, topk;  // topk 0: attend every compressed entry
  int64_t pos0;
  int max_entries;
  bool graph_position = false;  // position read from device memory
  bool store_window = false;    // decode: the launch also stores the row's key into its ring slot
};

void check_attention(const AttnCase& c) {
  SCOPED_TRACE(c.name);
  std::mt19937 rng(std::hash<std::string>{}(c.name));
  const int slots = c.window, last = int(c.pos0) + c.n - 1;
  const bool indexed = c.ratio && c.topk > 0;
  RopeConfig rope;
  rope.theta = 160000;
  rope.yarn = true;
  rope.factor = 16;
  rope.original_max_position = 4096;
  const std::vector<float> inv_freq = rope_inv_freq(rope, c.rope_dim);
  const std::vector<float> q = random_vector(size_t(c.n) * c.heads * c.dim, rng, -2.0f, 2.0f);
  const std::vector<float> chunk = random_vector(size_t(c.n) * c.dim, rng);
  const std::vector<float> ring = random_vector(size_t(slots) * c.dim, rng);
  const std::vector<float> comp = random_vector(size_t(std::max(c.max_entries, 1)) * c.dim, rng);
  const std::vector<float> sink = random_vector(c.heads, rng, -2.0f, 2.0f);
  std::vector<int32_t> selected(size_t(c.n) * std::max(c.topk, 1), -1);
  for (int t = 0; t < c.n && indexed; ++t) {
    const int visible = int((c.pos0 + t + 1) / c.ratio);
    std::vector<int32_t> all(visible);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    for (int i = 0; i < std::min(visible, c.topk); ++i) selected[size_t(t) * c.topk + i] = all[i];
  }
  if (c.ratio) {
    ASSERT_LE(last / c.ratio, c.max_entries) << "test setup: too few compressed entries";
  }

  DeviceBuffer dq = to_device(q), dchunk = to_device(chunk), dring = to_device(ring), dcomp = to_device(comp),
               dsink = to_device(sink), dsel = to_device(selected), dfreq = to_device(inv_freq);
  const int hpg = c.heads / c.groups, width = hpg * c.dim;
  DeviceBuffer out(size_t(c.n) * c.heads * c.dim * sizeof(uint16_t));
  out.fill_bytes(0xff);  // bf16 NaN
  gpu::AttentionParams p;
  p.q = dq.as<float>();
  p.q_token_stride = int64_t(c.heads) * c.dim;
  p.kv_chunk = dchunk.as<float>();
  p.window_ring = dring.as<float>();
  p.window_slots = slots;
  p.window = c.window;
  p.compressed = c.ratio ? dcomp.as<float>() : nullptr;
  p.ratio = c.ratio;
  p.selected = indexed ? dsel.as<int32_t>() : nullptr;
  p.topk = c.topk;
  p.sink = dsink.as<float>();
  p.inv_freq = dfreq.as<float>();
  p.rope_dim = c.rope_dim;
  p.n = c.n;
  p.heads = c.heads;
  p.dim = c.dim;
  p.groups = c.groups;
  p.pos0 = c.graph_position ? -12345 : c.pos0;  // must be ignored when the position comes from the device
  p.scale = 1.0f / std::sqrt(float(c.dim));
  p.out = out.as<uint16_t>();
  p.max_entries = c.max_entries;
  p.store_window = c.store_window;
  const std::vector<int64_t> pos_host = {c.pos0};
  DeviceBuffer dpos = to_device(pos_host);
  if (c.graph_position) p.pos_device = dpos.as<int64_t>();
  DeviceBuffer scratch(std::max<size_t>(gpu::attention_scratch_floats(p), 1) * sizeof(float));
  p.scratch = scratch.as<float>();
  gpu::attention(p, nullptr);
  sync();
  const std::vector<uint16_t> got = to_host<uint16_t>(out, size_t(c.n) * c.heads * c.dim);
  // Decode rows: 16 and 64 heads per block must give the same bits.
  if (gpu::attention_uses_tensor_cores(p) && c.n < 65) {
    const int chosen = gpu::attention_block_heads(p);
    for (const int heads : {16, 64}) {
      gpu::set_attention_decode_block_heads(heads);
      EXPECT_EQ(gpu::attention_block_heads(p), heads);
      out.fill_bytes(0xff);
      gpu::attention(p, nullptr);
      sync();
      gpu::set_attention_decode_block_heads(0);
      EXPECT_TRUE(to_host<uint16_t>(out, got.size()) == got)
          << c.name << ": " << heads << " heads per block differ from " << chosen;
    }
  }
  if (c.store_window) {  // the new key in slot pos0 % slots, every other slot as before (queries saw the old ring)
    const std::vector<float> ring_after = to_host<float>(dring, ring.size());
    for (int s = 0; s < slots; ++s)
      for (int i = 0; i < c.dim; ++i) {
        const float want = s == c.pos0 % slots ? chunk[i] : ring[size_t(s) * c.dim + i];
        ASSERT_EQ(ring_after[size_t(s) * c.dim + i], want) << "ring slot " << s << " dim " << i;
      }
  }
  // The tensor-core kernel (prefill chunks) works like the reference: bf16 q and keys, probabilities rounded to
  // bf16 for P·V. The fp64 reference then takes bf16 q and keys too, and allows 2^-8 of Σ_j w_j |k_j[i]| more for
  // the probability rounding.
  const bool tensor_cores = gpu::attention_uses_tensor_cores(p);
  auto in = [&](float v) { return tensor_cores ? double(round_bf16(v)) : double(v); };
  std::printf("[attention] %-28s splits %d%s\n", c.name.c_str(), gpu::attention_splits(p),
              tensor_cores ? fmt::format(", tensor cores, {} heads per block", gpu::attention_block_heads(p)).c_str()
                           : "");

  int bad = 0;
  double worst = 0;
  for (int t = 0; t < c.n; ++t) {
    const int64_t pos = c.pos0 + t, first = std::max<int64_t>(0, pos - c.window + 1);
    std::vector<const float*> keys;
    for (int64_t s = first; s <= pos; ++s)
      keys.push_back(s >= c.pos0 ? &chunk[size_t(s - c.pos0) * c.dim] : &ring[size_t(s % slots) * c.dim]);
    if (c.ratio) {
      const int visible = int((pos + 1) / c.ratio);
      if (indexed)
        for (int i = 0; i < std::min(visible, c.topk); ++i) keys.push_back(&comp[size_t(selected[size_t(t) * c.topk + i]) * c.dim]);
      else
        for (int e = 0; e < visible; ++e) keys.push_back(&comp[size_t(e) * c.dim]);
    }
    for (int h = 0; h < c.heads; ++h) {
      const float* qv = &q[(size_t(t) * c.heads + h) * c.dim];
      std::vector<double> logit(keys.size());
      double mx = sink[h];
      for (size_t j = 0; j < keys.size(); ++j) {
        double dot = 0;
        for (int i = 0; i < c.dim; ++i) dot += in(qv[i]) * in(keys[j][i]);
        logit[j] = dot / std::sqrt(double(c.dim));
        mx = std::max(mx, logit[j]);
      }
      double denom = std::exp(sink[h] - mx);
      std::vector<double> o(c.dim, 0.0), spread(c.dim, 0.0);
      for (size_t j = 0; j < keys.size(); ++j) {
        const double w = std::exp(logit[j] - mx);
        denom += w;
        for (int i = 0; i < c.dim; ++i) {
          o[i] += w * in(keys[j][i]);
          spread[i] += w * std::fabs(in(keys[j][i]));
        }
      }
      for (double& v : o) v /= denom;
      for (int i = 0; i < c.dim; ++i) spread[i] = tensor_cores ? 0x1p-8 * spread[i] / denom : 0.0;
      for (int i = c.dim - c.rope_dim; i + 1 < c.dim; i += 2) spread[i] = spread[i + 1] = std::max(spread[i], spread[i + 1]);
      for (int i = 0; i < c.rope_dim / 2; ++i) {  // inverse RoPE at pos
        const double angle = double(float(pos) * inv_freq[i]);
        const double cs = std::cos(angle), sn = -std::sin(angle);
        double& a = o[c.dim - c.rope_dim + 2 * i];
        double& b = o[c.dim - c.rope_dim + 2 * i + 1];
        const double a0 = a, b0 = b;
        a = a0 * cs - b0 * sn;
        b = a0 * sn + b0 * cs;
      }
      const int g = h / hpg;
      const uint16_t* row = &got[(size_t(g) * c.n + t) * width + size_t(h % hpg) * c.dim];
      for (int i = 0; i < c.dim; ++i) {
        const double v = bf16_to_f32(row[i]), err = std::fabs(v - o[i]), allowed = 4e-3 * std::fabs(o[i]) + 2e-5 + spread[i];
        worst = std::max(worst, err / allowed);
        if (!(err <= allowed) && ++bad <= 5)
          ADD_FAILURE() << "token " << t << " head " << h << " dim " << i << ": got " << v << ", want " << o[i];
      }
    }
  }
  EXPECT_EQ(bad, 0);
  std::printf("[attention] %-28s worst err/allowed %.3f\n", c.name.c_str(), worst);
}

TEST(CudaAttention, DecodeCsaSplitKeys) {
  DSV4_REQUIRE_CUDA();
  check_attention({"decode_csa", 1, 64, 8, 512, 64, 128, 4, 512, 8210, 2100});
}

TEST(CudaAttention, DecodeCsaGraphPosition) {
  DSV4_REQUIRE_CUDA();
  check_attention({"decode_csa_pos_device", 1, 64, 8, 512, 64, 128, 4, 512, 8210, 2100, true});
}

TEST(CudaAttention, DecodeStoresItsKeyInTheRing) {
  DSV4_REQUIRE_CUDA();
  check_attention({"decode_csa_store", 1, 64, 8, 512, 64, 128, 4, 512, 8210, 2100, true, true});
  check_attention({"decode_sliding_store_short", 1, 8, 2, 128, 64, 128, 0, 0, 50, 0, false, true});
  check_attention({"decode_head_groups_store", 1, 512, 8, 64, 32, 32, 4, 16, 1000, 260, false, true});  // 512 heads
}

TEST(CudaAttention, DecodeHcaAllEntries) {
  DSV4_REQUIRE_CUDA();
  check_attention({"decode_hca", 1, 64, 8, 512, 64, 128, 128, 0, 8210, 80});
}

TEST(CudaAttention, DecodeSlidingWindowFromRing) {
  DSV4_REQUIRE_CUDA();
  check_attention({"decode_sliding_ring", 1, 64, 8, 512, 64, 128, 0, 0, 300, 0});
  check_attention({"decode_sliding_short", 1, 64, 8, 512, 64, 128, 0, 0, 50, 0});
}

TEST(CudaAttention, DecodeBatchOfEightCsa) {
  DSV4_REQUIRE_CUDA();
  check_attention({"eight_tokens_csa", 8, 64, 8, 512, 64, 128, 4, 512, 8210, 2100});
}

TEST(CudaAttention, SixteenTokensHeadGroupsSplitKeys) {
  DSV4_REQUIRE_CUDA();
  check_attention({"sixteen_tokens_csa_groups", 16, 64, 8, 512, 64, 128, 4, 512, 8210, 2100});
  check_attention({"sixteen_tokens_hca_groups", 16, 64, 8, 512, 64, 128, 128, 0, 8210, 80});
}

TEST(CudaAttention, FewTokensSplitKeysOddShapes) {
  DSV4_REQUIRE_CUDA();
  check_attention({"three_tokens_csa_dim96", 3, 8, 2, 96, 32, 32, 4, 200, 1000, 260});
  check_attention({"two_tokens_fewer_entries_than_topk", 2, 4, 1, 64, 16, 16, 4, 300, 500, 130});
}

TEST(CudaAttention, PrefillChunkHeadGroups) {
  DSV4_REQUIRE_CUDA();
  check_attention({"prefill_csa", 64, 16, 4, 512, 64, 128, 4, 512, 2000, 600});
  check_attention({"prefill_hca_start", 64, 16, 4, 512, 64, 128, 128, 0, 0, 8});
}

// More than 64 rows with head dim 512 or 128: the tensor-core kernel (64 heads per block; fewer heads are padded,
// more take several blocks; partial key tiles; window keys from the chunk and the ring).
TEST(CudaAttention, PrefillChunkTensorCores) {
  DSV4_REQUIRE_CUDA();
  check_attention({"prefill_csa_tc", 100, 64, 8, 512, 64, 128, 4, 512, 2000, 600});
  check_attention({"prefill_csa_tc_few_entries", 130, 128, 8, 512, 64, 128, 4, 512, 30, 60});
  check_attention({"prefill_hca_tc_start", 200, 64, 8, 512, 64, 128, 128, 0, 0, 8});
  check_attention({"prefill_sliding_tc_dim128", 70, 6, 2, 128, 64, 16, 0, 0, 40, 0});
  check_attention({"prefill_csa_tc_dim128_all", 150, 4, 1, 128, 64, 128, 4, 0, 0, 40});
  // Long rows (ten key tiles) with the ring, the picks and all entries.
  check_attention({"prefill_csa_tc_long", 96, 64, 8, 512, 64, 128, 4, 512, 5000, 1300});
  check_attention({"prefill_hca_tc_all_long", 80, 64, 8, 512, 64, 128, 128, 0, 60000, 480});
}

}  // namespace
}  // namespace dsv4
