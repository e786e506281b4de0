// SPDX-License-Identifier: MIT
// Sampler: greedy ties, and for temperature / top-k / top-p the frequencies of many draws against the exact
// distribution of the definition (softmax of logits / temperature over the top-k ids, then the shortest prefix in
// descending order, lower id first among equal logits, whose probability reaches top_p), computed here by a full
// sort in fp64. Every drawn id must lie in that set; each frequency within 5 standard deviations (+ 0.002) of its
// probability, so a wrong temperature, a nucleus one token off or a tie broken the other way fails.
// The draw contract itself (formats/token_draw.h: fixed-point weights, pivot cut, id-order walk) is checked exactly
// against a full-sort implementation of it, for given uniforms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "formats/token_draw.h"
#include "model/sampler.h"

namespace {

using dsv4::Sampler;
using dsv4::SamplingParams;
using dsv4::TokenDraw;

bool before(const std::vector<float>& logits, int a, int b) {
  return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
}

// The contract of formats/token_draw.h by a full sort: the cut (ids in "before" order up to the pivot) and the id
// the walk in id order picks for d.u.
struct ContractDraw {
  std::vector<int> cut;  // ascending ids
  int id = -1;
};
ContractDraw contract_draw(const std::vector<float>& row, const TokenDraw& d) {
  const std::vector<float> logits(row.begin(), row.begin() + (d.vocab > 0 ? d.vocab : int(row.size())));
  const int V = int(logits.size());
  ContractDraw out;
  if (d.temperature == 0.0f) {
    out.id = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
    out.cut = {out.id};
    return out;
  }
  const float mx = *std::max_element(logits.begin(), logits.end()), inv_t = 1.0f / d.temperature;
  std::vector<uint64_t> w(V);
  for (int i = 0; i < V; ++i) w[i] = dsv4::draw_weight(logits[i], mx, inv_t);
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return before(logits, a, b); });
  int keep = d.top_k > 0 ? std::min(d.top_k, V) : V;
  if (d.top_p < 1.0f) {
    uint64_t total = 0, acc = 0;
    for (int i = 0; i < keep; ++i) total += w[order[i]];
    const uint64_t target = dsv4::nucleus_target(d.top_p, total);
    for (int i = 0; i < keep; ++i)
      if ((acc += w[order[i]]) >= target) {
        keep = i + 1;
        break;
      }
  }
  out.cut.assign(order.begin(), order.begin() + keep);
  std::sort(out.cut.begin(), out.cut.end());
  uint64_t total = 0, acc = 0;
  for (int id : out.cut) total += w[id];
  const uint64_t r = dsv4::draw_point(d.u, total);
  for (int id : out.cut)
    if ((acc += w[id]) > r) {
      out.id = id;
      break;
    }
  return out;
}

// id -> probability of the definition above.
std::map<int, double> expected_distribution(const std::vector<float>& logits, const SamplingParams& p) {
  const int V = int(logits.size());
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  const int k = p.top_k > 0 ? std::min(p.top_k, V) : V;
  std::vector<double> w(k);
  double total = 0;
  for (int i = 0; i < k; ++i) total += (w[i] = std::exp((double(logits[order[i]]) - logits[order[0]]) / p.temperature));
  int keep = k;
  double cumulative = 0;
  for (int i = 0; i < k; ++i)
    if ((cumulative += w[i] / total) >= p.top_p) {
      keep = i + 1;
      break;
    }
  double kept = 0;
  for (int i = 0; i < keep; ++i) kept += w[i];
  std::map<int, double> dist;
  for (int i = 0; i < keep; ++i) dist[order[i]] = w[i] / kept;
  return dist;
}

void check_frequencies(const std::vector<float>& logits, SamplingParams p, int draws) {
  const std::map<int, double> want = expected_distribution(logits, p);
  Sampler sampler(p);
  std::map<int, int> count;
  for (int i = 0; i < draws; ++i) {
    const int id = sampler.sample(logits);
    ASSERT_TRUE(want.count(id)) << "drew id " << id << " outside the kept set (T " << p.temperature << ", top_p "
                                << p.top_p << ", top_k " << p.top_k << ")";
    ++count[id];
  }
  for (const auto& [id, prob] : want) {
    const double freq = double(count[id]) / draws, sigma = std::sqrt(prob * (1 - prob) / draws);
    EXPECT_NEAR(freq, prob, 5 * sigma + 0.002) << "id " << id << " (T " << p.temperature << ", top_p " << p.top_p
                                               << ", top_k " << p.top_k << ")";
  }
}

std::vector<float> random_logits(int V, float spread, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, spread);
  std::vector<float> logits(V);
  for (float& v : logits) v = normal(rng);
  return logits;
}

TEST(Sampler, GreedyTakesTheLowestIdAmongEqualMaxima) {
  Sampler greedy(SamplingParams{});
  EXPECT_EQ(greedy.sample(std::vector<float>{1.0f, 3.0f, -2.0f, 3.0f}), 1);
  EXPECT_EQ(greedy.sample(std::vector<float>{-5.0f}), 0);
}

TEST(Sampler, TopKOfOneIsGreedyAtAnyTemperature) {
  const std::vector<float> logits = random_logits(1000, 2.0f, 3);
  const int argmax = int(std::max_element(logits.begin(), logits.end()) - logits.begin());
  Sampler sampler(SamplingParams{5.0f, 1.0f, 1, 11});
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sampler.sample(logits), argmax);
}

TEST(Sampler, SmallVocabularyMatchesTheDefinition) {
  std::vector<float> logits = random_logits(40, 1.0f, 5);
  logits[7] = logits[21] = logits[30] = 1.5f;  // ties inside the nucleus: the lower id comes first
  check_frequencies(logits, {1.0f, 1.0f, 0, 1}, 40000);   // whole distribution (drawn in id order)
  check_frequencies(logits, {0.6f, 1.0f, 0, 2}, 40000);   // sharper
  check_frequencies(logits, {1.4f, 0.8f, 0, 3}, 40000);   // nucleus only
  check_frequencies(logits, {1.0f, 1.0f, 6, 4}, 40000);   // top-k only
  check_frequencies(logits, {0.9f, 0.7f, 12, 5}, 40000);  // both
  // Cuts inside a run of equal logits keep the lower ids.
  check_frequencies({2.0f, 1.0f, 1.0f, 1.0f, 0.0f}, {1.0f, 1.0f, 2, 8}, 4000);         // top-k: ids 0 and 1
  check_frequencies({1.0f, 1.0f, 1.0f, 1.0f}, {1.0f, 0.5f, 0, 9}, 4000);               // top-p: ids 0 and 1
  check_frequencies(std::vector<float>(300, 0.5f), {1.0f, 0.1f, 0, 10}, 4000);         // 30 of 300 ties
  // More than the 64 ids taken first: the nucleus comes from the selection (200 of 1000 ties, then the same with
  // three heavier ids in front and the cut inside the ties). A missing or extra last id fails here.
  check_frequencies(std::vector<float>(1000, 0.25f), {1.0f, 0.2f, 0, 11}, 40000);
  std::vector<float> steps(1000, 0.0f);
  steps[500] = steps[600] = steps[700] = 3.0f;
  check_frequencies(steps, {1.0f, 0.3f, 0, 12}, 40000);
}

TEST(Sampler, LargeVocabularyNucleusGrowsPastTheFirstPrefixes) {
  // A flat distribution over 20000 ids: top_p 0.9 keeps thousands of ids, more than the first prefixes of 64, 256
  // and 1024 that the sampler sorts before it sorts more.
  const std::vector<float> logits = random_logits(20000, 0.5f, 9);
  const SamplingParams p{1.0f, 0.9f, 0, 6};
  const std::map<int, double> want = expected_distribution(logits, p);
  ASSERT_GT(want.size(), 4096u);
  Sampler sampler(p);
  for (int i = 0; i < 300; ++i) ASSERT_TRUE(want.count(sampler.sample(logits)));
  // The nucleus boundary: the kept set's weakest id can be drawn, the next one in order never.
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  EXPECT_TRUE(want.count(order[want.size() - 1]));
  EXPECT_FALSE(want.count(order[want.size()]));
}

TEST(Sampler, MidSizeVocabularyMatchesTheDefinition) {
  const std::vector<float> logits = random_logits(3000, 2.0f, 17);
  check_frequencies(logits, {0.5f, 0.9f, 0, 14}, 20000);
  check_frequencies(logits, {0.5f, 1.0f, 0, 15}, 20000);
  check_frequencies(logits, {1.0f, 0.95f, 200, 16}, 20000);
}

// The cut itself, exactly (the contract's, by a full sort): for many shapes (vocabulary sizes, spreads, ties, temperatures, top-k and top-p, nuclei
// from one id to thousands, so both the first 64 ids and the selection decide it) the kept ids are the definition's.
TEST(Sampler, KeptIdsAreTheDefinitionsCut) {
  std::mt19937 rng(77);
  int cases = 0, big = 0;
  for (int V : {50, 700, 5000, 40000})
    for (float spread : {0.05f, 0.7f, 3.0f})
      for (int tied : {0, 1})
        for (const SamplingParams& p : {SamplingParams{1.0f, 0.5f, 0, 1}, SamplingParams{0.7f, 0.9f, 0, 1},
                                        SamplingParams{1.5f, 0.99f, 0, 1}, SamplingParams{1.0f, 0.3f, 200, 1},
                                        SamplingParams{1.0f, 1.0f, 7, 1}}) {
          std::vector<float> logits = random_logits(V, spread, uint32_t(rng()));
          if (tied)  // runs of equal logits across the cut
            for (float& l : logits) l = std::round(l * 4.0f) / 4.0f;
          TokenDraw d{p.temperature, p.top_p, p.top_k, 0, 0.0};
          const std::vector<int> cut = contract_draw(logits, d).cut;
          Sampler sampler(p);
          const std::vector<int32_t> got = sampler.kept_ids(logits);
          ASSERT_EQ(got, std::vector<int32_t>(cut.begin(), cut.end())) << "V " << V << " spread " << spread << " tied " << tied << " T " << p.temperature
                                   << " top_p " << p.top_p << " top_k " << p.top_k;
          ++cases;
          big += cut.size() > 64;
        }
  EXPECT_EQ(cases, 120);
  EXPECT_GT(big, 20);  // the selection path decided many of them
  // Exact hits of top_p (equal weights, sums exact in binary): the cut keeps the id that reaches it and no more.
  for (const auto& [V, top_p, kept] : std::vector<std::tuple<int, float, int>>{{4, 0.5f, 2}, {1000, 0.25f, 250},
                                                                               {4096, 0.125f, 512}}) {
    Sampler sampler(SamplingParams{1.0f, top_p, 0, 1});
    std::vector<int32_t> want(static_cast<size_t>(kept));
    std::iota(want.begin(), want.end(), 0);
    const std::vector<int32_t> got = sampler.kept_ids(std::vector<float>(size_t(V), 1.0f));
    EXPECT_EQ(got, want) << V << " equal logits, top_p " << top_p;
  }
}

TEST(Sampler, SameSeedSameDraws) {
  const std::vector<float> logits = random_logits(5000, 2.0f, 13);
  for (const SamplingParams& p : {SamplingParams{1.0f, 1.0f, 0, 42}, SamplingParams{0.8f, 0.95f, 0, 42},
                                  SamplingParams{0.8f, 0.95f, 40, 42}}) {
    Sampler a(p), b(p);
    for (int i = 0; i < 100; ++i) ASSERT_EQ(a.sample(logits), b.sample(logits));
  }
}

// draw_weight: exp in fixed point. Within 4e-6 of exp(x) · 2^40 (plus the rounding to an integer), 2^40 at the maximum, 0 far
// below it, never decreasing with x (a larger logit never weighs less).
TEST(DrawContract, WeightIsExpInFixedPoint) {
  EXPECT_EQ(dsv4::draw_weight_of(0.0f), uint64_t(1) << dsv4::kDrawWeightBits);
  EXPECT_EQ(dsv4::draw_weight_of(-29.0f), 0u);
  EXPECT_EQ(dsv4::draw_weight_of(-std::numeric_limits<float>::infinity()), 0u);
  EXPECT_EQ(dsv4::draw_weight_of(std::nanf("")), 0u);
  uint64_t previous = 0;
  int checked = 0;
  for (float x = -30.0f; x <= 0.0f; x = std::nextafter(x, 1.0f) + 1e-4f) {
    const uint64_t w = dsv4::draw_weight_of(x);
    ASSERT_GE(w, previous) << "x " << x;
    previous = w;
    const double want = std::exp(double(x)) * 0x1.0p40;
    if (want > 1e6) {  // below, the rounding to an integer dominates
      ASSERT_NEAR(double(w) / want, 1.0, 4e-6) << "x " << x;
      ++checked;
    } else {
      ASSERT_NEAR(double(w), want, 4e-6 * want + 0.5) << "x " << x;
    }
  }
  EXPECT_GT(checked, 100000);
  EXPECT_EQ(dsv4::draw_weight(3.0f, 3.0f, 2.0f), uint64_t(1) << 40);
  EXPECT_EQ(dsv4::draw_weight(1.0f, 3.0f, 0.5f), dsv4::draw_weight_of(-1.0f));
}

TEST(DrawContract, TargetAndPointStayInsideTheTotal) {
  EXPECT_EQ(dsv4::nucleus_target(0.5f, 4), 2u);
  EXPECT_EQ(dsv4::nucleus_target(0.3f, 10), 4u);  // 0.3f is 0.30000001: the target is the ceiling of 3.0000001
  EXPECT_EQ(dsv4::nucleus_target(1e-9f, 1000), 1u);
  EXPECT_EQ(dsv4::nucleus_target(0.9999f, 1), 1u);
  EXPECT_EQ(dsv4::draw_point(0.0, 10), 0u);
  EXPECT_EQ(dsv4::draw_point(0.55, 10), 5u);
  EXPECT_EQ(dsv4::draw_point(std::nextafter(1.0, 0.0), uint64_t(1) << 57), (uint64_t(1) << 57) - 16);  // exact
  for (uint64_t total = (uint64_t(1) << 57) - 40; total < (uint64_t(1) << 57) + 40; ++total)  // totals that round
    ASSERT_LT(dsv4::draw_point(std::nextafter(1.0, 0.0), total), total);
  EXPECT_EQ(dsv4::draw_point(0.5, 0), 0u);
}

TEST(DrawContract, KeysFollowTheLogitOrder) {
  const std::vector<float> v{-std::numeric_limits<float>::infinity(), -1e30f, -2.5f, -1e-30f, 0.0f, 1e-30f, 1.0f,
                             3e38f};
  for (size_t i = 0; i + 1 < v.size(); ++i) EXPECT_LT(dsv4::float_order_key(v[i]), dsv4::float_order_key(v[i + 1]));
  EXPECT_EQ(dsv4::float_order_key(-0.0f), dsv4::float_order_key(0.0f));
  for (float x : v)
    if (x != 0.0f) EXPECT_EQ(dsv4::float_of_order_key(dsv4::float_order_key(x)), x);
  EXPECT_EQ(dsv4::f32_to_bits(dsv4::float_of_order_key(dsv4::float_order_key(-0.0f))), 0u);  // +0
}

// Sampler::draw is the contract: the same id as the full-sort implementation for every u tried, over shapes with
// ties across the cuts, cuts of one id to thousands, a vocabulary limit below the row, and u at 0 and just below 1.
TEST(DrawContract, SamplerDrawIsTheContract) {
  std::mt19937 rng(2024);
  int cases = 0;
  for (int V : {1, 2, 37, 700, 5000, 40000})
    for (float spread : {0.0f, 0.3f, 4.0f})
      for (int tied : {0, 1})
        for (const TokenDraw& base :
             {TokenDraw{1.0f, 1.0f, 0, 0, 0}, TokenDraw{0.6f, 0.9f, 0, 0, 0}, TokenDraw{1.3f, 0.5f, 0, 0, 0},
              TokenDraw{1.0f, 1.0f, 50, 0, 0}, TokenDraw{0.8f, 0.95f, 2000, 0, 0}, TokenDraw{2.0f, 0.2f, 3, 0, 0},
              TokenDraw{0.0f, 1.0f, 0, 0, 0}}) {
          std::vector<float> logits = random_logits(V, spread, uint32_t(rng()));
          if (tied)
            for (float& l : logits) l = std::round(l * 2.0f) / 2.0f;
          TokenDraw d = base;
          d.vocab = V > 2 && (rng() & 1) ? V - 1 - int(rng() % uint32_t(V / 3)) : 0;
          if (d.vocab > 0) logits[size_t(V - 1)] = 100.0f;  // past the limit: never drawn
          Sampler sampler(SamplingParams{});
          for (double u : {0.0, std::nextafter(1.0, 0.0), 0.5, 0.123456789, 0.999}) {
            d.u = u;
            const ContractDraw want = contract_draw(logits, d);
            ASSERT_GE(want.id, 0);
            ASSERT_EQ(sampler.draw(logits, d), want.id)
                << "V " << V << " vocab " << d.vocab << " spread " << spread << " tied " << tied << " T "
                << d.temperature << " top_p " << d.top_p << " top_k " << d.top_k << " u " << u;
            ++cases;
          }
        }
  EXPECT_EQ(cases, 6 * 3 * 2 * 7 * 5);
}

TEST(DrawContract, NextDrawCarriesTheParametersAndAUniform) {
  Sampler greedy(SamplingParams{});
  EXPECT_EQ(greedy.next_draw(10).u, 0.0);
  Sampler a(SamplingParams{0.7f, 0.9f, 40, 5}), b(SamplingParams{0.7f, 0.9f, 40, 5});
  const TokenDraw d = a.next_draw(1234);
  EXPECT_EQ(d.temperature, 0.7f);
  EXPECT_EQ(d.top_p, 0.9f);
  EXPECT_EQ(d.top_k, 40);
  EXPECT_EQ(d.vocab, 1234);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const double u = a.next_draw(5).u;
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
  // sample() is next_draw() then draw(): the same generator, so the same ids as drawing by hand.
  const std::vector<float> logits = random_logits(300, 1.5f, 4);
  b.next_draw(1234);
  for (int i = 0; i < 10000; ++i) b.next_draw(5);
  Sampler c(SamplingParams{0.7f, 0.9f, 40, 5});
  c.next_draw(1);
  for (int i = 0; i < 10000; ++i) c.next_draw(1);
  for (int i = 0; i < 50; ++i) ASSERT_EQ(b.sample(logits), c.draw(logits, c.next_draw(300)));
}

}  // namespace
