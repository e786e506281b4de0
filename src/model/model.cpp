// SPDX-License-Identifier: MIT
// The DeepSeek-V4 forward pass, written to read like the spec (section numbers in comments). fp32 throughout;
// the only deliberate roundings are the simulated KV / indexer storage formats chosen in Numerics.
#include "model/model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <numeric>

#include "core/check.h"
#include "formats/fp8.h"
#include "io/safetensors.h"

namespace dsv4 {

using cpu::gemm_nt;

cpu::KvStorage parse_kv_storage(const std::string& name) {
  if (name == "fp8") return cpu::KvStorage::FP8;
  if (name == "bf16") return cpu::KvStorage::BF16;
  if (name == "f32") return cpu::KvStorage::F32;
  DSV4_FAIL("unknown KV cache dtype \"{}\" (expected fp8, bf16 or f32)", name);
}

cpu::IndexerStorage parse_indexer_storage(const std::string& name) {
  if (name == "fp4") return cpu::IndexerStorage::FP4;
  if (name == "bf16") return cpu::IndexerStorage::BF16;
  if (name == "f32") return cpu::IndexerStorage::F32;
  DSV4_FAIL("unknown indexer dtype \"{}\" (expected fp4, bf16 or f32)", name);
}

ActQuant parse_act_quant(const std::string& name) {
  if (name == "none") return ActQuant::None;
  if (name == "fp8") return ActQuant::FP8;
  DSV4_FAIL("unknown activation quantisation \"{}\" (expected none or fp8)", name);
}

StateCodecs state_codecs(const Numerics& numerics) {
  using cpu::IndexerStorage, cpu::KvStorage;
  StateCodecs c;
  c.kv = numerics.kv == KvStorage::FP8 ? KvCodec::Fp8 : numerics.kv == KvStorage::BF16 ? KvCodec::Bf16 : KvCodec::F32;
  c.index = numerics.indexer == IndexerStorage::FP4    ? KvCodec::Fp4
            : numerics.indexer == IndexerStorage::BF16 ? KvCodec::Bf16
                                                       : KvCodec::F32;
  return c;
}

namespace {

// y[M, rows] (row stride ldy; += when accumulate) = x[M, w.cols] (row stride ldx) · W[row0 .. row0 + rows]ᵀ for a
// linear layer's weight held as fp32 values (gemm_nt, BLAS) or left in its checkpoint encoding
// (WeightLoad::KeepLinearsPacked: cpu::gemm_nt_packed decodes a tile of rows at a time).
void linear_rows(const float* x, int ldx, const Matrix& w, int row0, int rows, float* y, int ldy, int M,
                 bool accumulate = false) {
  if (w.has_values()) {
    const float* wr = w.row(row0);
    if (accumulate) {
      DSV4_CHECK(ldx == w.cols && ldy == rows, "linear: accumulate takes contiguous rows");
      cpu::gemm_nt_accumulate(x, wr, y, M, rows, w.cols);
    } else if (ldx == w.cols && ldy == rows) {
      gemm_nt(x, wr, y, M, rows, w.cols);
    } else {
      cpu::gemm_nt_strided(x, ldx, wr, y, ldy, M, rows, w.cols);
    }
    return;
  }
  DSV4_CHECK(w.packed.has_value(), "the CPU forward needs the weights' values; this model holds shapes only "
                                   "(a synthetic benchmark model)");
  cpu::gemm_nt_packed(x, ldx, *w.packed, row0, y, ldy, M, rows, w.cols, accumulate);
}

// y[M, w.rows] = x[M, w.cols] · Wᵀ (+= when accumulate).
void linear(const float* x, const Matrix& w, float* y, int M, bool accumulate = false) {
  linear_rows(x, w.cols, w, 0, w.rows, y, w.rows, M, accumulate);
}

// The input of an FP8/FP4 linear (8.1): x itself, or its quantised copy in `buf` (rows of k values). The
// reference's act_quant sees bf16 activations, so x is rounded to bf16 first: the double rounding decides ~3 % of
// the e4m3 values, and the tiny models amplify such flips to O(1) logit changes (CudaModel act fp8 test).
const float* linear_input(ActQuant act, const float* x, int rows, int k, std::vector<float>& buf) {
  if (act == ActQuant::None) return x;
  buf.resize(size_t(rows) * k);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = round_bf16(x[i]);
  for (int r = 0; r < rows; ++r)
    for (int b = 0; b < k; b += 128) fp8_simulate_block(&buf[size_t(r) * k + b], std::min(128, k - b));
  return buf.data();
}

}  // namespace

std::vector<float> rope_inv_freq(const RopeConfig& rope, int dim) {
  std::vector<float> inv(dim / 2);
  // Same fp32 operations as the references: base^(2i/d) in fp32, then reciprocal.
  for (int i = 0; i < dim / 2; ++i) inv[i] = 1.0f / std::pow(float(rope.theta), float(2 * i) / float(dim));
  if (!rope.yarn) return inv;
  auto correction_dim = [&](double rotations) {
    return dim * std::log(rope.original_max_position / (rotations * 2.0 * std::numbers::pi)) /
           (2.0 * std::log(rope.theta));
  };
  const double low = std::max(std::floor(correction_dim(rope.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(rope.beta_slow)), double(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < dim / 2; ++i) {
    const float ramp = std::clamp(float((i - low) / (high - low)), 0.0f, 1.0f);
    const float extrapolated = inv[i], interpolated = inv[i] / float(rope.factor);
    inv[i] = interpolated * ramp + extrapolated * (1.0f - ramp);
  }
  return inv;
}

Model::Model(ModelConfig config, ModelWeights weights, Numerics numerics)
    : config_(std::move(config)), weights_(std::move(weights)), numerics_(numerics) {
  inv_freq_main_ = rope_inv_freq(config_.rope_main, config_.rope_dim);
  inv_freq_compress_ = rope_inv_freq(config_.rope_compress, config_.rope_dim);
}

Model Model::load(const std::string& dir, Numerics numerics, WeightLoad load, bool mtp) {
  ModelConfig config = ModelConfig::from_model_dir(dir);
  auto checkpoint = std::make_shared<const Checkpoint>(Checkpoint::open(dir));
  return Model(config, load_weights(config, checkpoint, load, mtp), numerics);
}

const LayerWeights& Model::block(int l) const {
  return l < config_.n_layers ? weights_.layers[size_t(l)] : weights_.mtp->block;
}

void Model::trace(const char* name, int layer, const float* data, int rows, int cols) const {
  if (trace_) trace_(name, layer, data, rows, cols);
}

struct Model::Chunk {
  std::span<const int32_t> tokens;
  int64_t pos0 = 0;  // position of tokens[0]
  int n() const { return int(tokens.size()); }
};

namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// (mean(x²) + eps)^-½ over all hc·D values of a token's streams (spec 2.3: one RMS, not one per stream).
float streams_inv_rms(const float* xs, int width, float eps) {
  double sum_sq = 0;
  for (int i = 0; i < width; ++i) sum_sq += double(xs[i]) * xs[i];
  return 1.0f / std::sqrt(float(sum_sq / width) + eps);
}

// mHC "pre" (spec 2.3): mixing weights from all hc streams, Sinkhorn-normalised combine matrix, collapsed input.
//   streams [n, hc, D] -> collapsed [n, D], post [n, hc], comb [n, hc, hc] (comb[j][k]: from stream j to k)
void hc_pre(const HyperConnWeights& w, const ModelConfig& c, const float* streams, int n, float* collapsed,
            float* post, float* comb) {
  const int hc = c.hc_mult, D = c.hidden_size, width = hc * D, n_mix = (2 + hc) * hc;
  std::vector<float> mix(size_t(n) * n_mix);
  gemm_nt(streams, w.fn.data.data(), mix.data(), n, n_mix, width);
#pragma omp parallel for if (n > 16)
  for (int t = 0; t < n; ++t) {
    const float* xs = streams + int64_t(t) * width;
    const float rs = streams_inv_rms(xs, width, c.rms_norm_eps);
    const float* m = mix.data() + int64_t(t) * n_mix;
    std::vector<float> pre(hc);
    for (int k = 0; k < hc; ++k) {
      pre[k] = sigmoid(m[k] * rs * w.scale[0] + w.base[k]) + c.hc_eps;
      post[t * hc + k] = 2.0f * sigmoid(m[hc + k] * rs * w.scale[1] + w.base[hc + k]);
    }
    float* C = comb + int64_t(t) * hc * hc;
    for (int j = 0; j < hc; ++j) {  // row softmax, then + eps
      float* row = C + j * hc;
      float mx = -std::numeric_limits<float>::infinity();
      for (int k = 0; k < hc; ++k) {
        row[k] = m[2 * hc + j * hc + k] * rs * w.scale[2] + w.base[2 * hc + j * hc + k];
        mx = std::max(mx, row[k]);
      }
      float sum = 0;
      for (int k = 0; k < hc; ++k) sum += (row[k] = std::exp(row[k] - mx));
      for (int k = 0; k < hc; ++k) row[k] = row[k] / sum + c.hc_eps;
    }
    auto normalize_cols = [&] {
      for (int k = 0; k < hc; ++k) {
        float sum = 0;
        for (int j = 0; j < hc; ++j) sum += C[j * hc + k];
        for (int j = 0; j < hc; ++j) C[j * hc + k] /= sum + c.hc_eps;
      }
    };
    normalize_cols();
    for (int it = 1; it < c.hc_sinkhorn_iters; ++it) {
      for (int j = 0; j < hc; ++j) {
        float sum = 0;
        for (int k = 0; k < hc; ++k) sum += C[j * hc + k];
        for (int k = 0; k < hc; ++k) C[j * hc + k] /= sum + c.hc_eps;
      }
      normalize_cols();
    }
    float* a = collapsed + int64_t(t) * D;
    for (int d = 0; d < D; ++d) {
      float acc = 0;
      for (int k = 0; k < hc; ++k) acc += pre[k] * xs[k * D + d];
      a[d] = acc;
    }
  }
}

// mHC "post" (spec 2.4): streams[k] <- post_k · out + Σ_j comb[j][k] · streams[j]   (Cᵀ·R, not C·R)
void hc_post(const ModelConfig& c, const float* out, const float* post, const float* comb, int n, float* streams) {
  const int hc = c.hc_mult, D = c.hidden_size;
#pragma omp parallel for if (n > 16)
  for (int t = 0; t < n; ++t) {
    float* xs = streams + int64_t(t) * hc * D;
    const std::vector<float> old(xs, xs + hc * D);
    const float* C = comb + int64_t(t) * hc * hc;
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < D; ++d) {
        float acc = post[t * hc + k] * out[int64_t(t) * D + d];
        for (int j = 0; j < hc; ++j) acc += C[j * hc + k] * old[j * D + d];
        xs[k * D + d] = acc;
      }
  }
}

// Final collapse (spec 2.5): no Sinkhorn, no factor 2.
void hc_head(const HyperConnWeights& w, const ModelConfig& c, const float* streams, int n, float* y) {
  const int hc = c.hc_mult, D = c.hidden_size, width = hc * D;
  std::vector<float> mix(size_t(n) * hc);
  gemm_nt(streams, w.fn.data.data(), mix.data(), n, hc, width);
  for (int t = 0; t < n; ++t) {
    const float* xs = streams + int64_t(t) * width;
    const float rs = streams_inv_rms(xs, width, c.rms_norm_eps);
    for (int d = 0; d < D; ++d) y[int64_t(t) * D + d] = 0;
    for (int k = 0; k < hc; ++k) {
      const float pre = sigmoid(mix[t * hc + k] * rs * w.scale[0] + w.base[k]) + c.hc_eps;
      for (int d = 0; d < D; ++d) y[int64_t(t) * D + d] += pre * xs[k * D + d];
    }
  }
}

// Advances a KV compressor by the chunk's tokens (spec 3.5, reference state layout) and writes every entry that
// completes into `entries` [max_entries, dim]; `finish(entry, b)` post-processes an entry (norm, RoPE, rounding).
template <typename Finish>
void advance_compressor(CompressorState& st, const CompressorWeights& w, const float* x, int n, int64_t pos0, int D,
                        KvEntries& entries, int& n_entries, Finish finish) {
  const int r = st.ratio, d = st.dim, width = st.width;
  std::vector<float> u(size_t(n) * width), g(size_t(n) * width), entry(d);
  linear(x, w.wkv, u.data(), n);
  linear(x, w.wgate, g.data(), n);
  st.undo.clear();
  for (int t = 0; t < n; ++t) {
    const int64_t p = pos0 + t;
    const int i = int(p % r), row = st.overlap ? r + i : i;
    const bool undoable = t >= n - kMaxRollback;
    if (undoable) st.remember(p, row, 1);
    for (int j = 0; j < width; ++j) {
      st.kv[size_t(row) * width + j] = u[size_t(t) * width + j];
      st.score[size_t(row) * width + j] = g[size_t(t) * width + j] + w.ape.row(i)[j];
    }
    if ((p + 1) % r != 0) continue;
    const int b = int(p / r);
    DSV4_CHECK(b < entries.rows(), "compressed KV cache full ({} entries)", entries.rows());
    for (int j = 0; j < d; ++j) {
      // Candidate (row, column) pairs: overlapped = previous block's first half + current block's second half.
      const int n_rows = st.overlap ? 2 * r : r;
      auto column = [&](int rr) { return st.overlap && rr >= r ? d + j : j; };
      float mx = -std::numeric_limits<float>::infinity();
      for (int rr = 0; rr < n_rows; ++rr) mx = std::max(mx, st.score[size_t(rr) * width + column(rr)]);
      float sum = 0, acc = 0;
      for (int rr = 0; rr < n_rows; ++rr) {
        const float e = std::exp(st.score[size_t(rr) * width + column(rr)] - mx);
        sum += e;
        acc += e * st.kv[size_t(rr) * width + column(rr)];
      }
      entry[j] = acc / sum;
    }
    finish(entry.data(), b);
    entries.put(b, entry.data());
    n_entries = b + 1;
    if (st.overlap) {
      if (undoable) st.remember(p, 0, r);
      std::copy(st.kv.begin() + size_t(r) * width, st.kv.end(), st.kv.begin());
      std::copy(st.score.begin() + size_t(r) * width, st.score.end(), st.score.begin());
    }
  }
}

}  // namespace

void Model::attention(int l, const float* x, Chunk& chunk, LayerState& S, const SequenceState& state,
                      float* out) const {
  const ModelConfig& c = config_;
  const AttentionWeights& A = block(l).attn;
  const int n = chunk.n(), D = c.hidden_size, H = c.n_heads, hd = c.head_dim, rd = c.rope_dim, nope = hd - rd;
  const float* inv_freq = c.has_compressor(l) ? inv_freq_compress_.data() : inv_freq_main_.data();

  // 3.2 query path
  std::vector<float> qr(size_t(n) * c.q_lora_rank), q(size_t(n) * H * hd), x_act, qr_act;
  const float* x_in = linear_input(numerics_.act, x, n, D, x_act);
  linear(x_in, A.wq_a, qr.data(), n);
  cpu::rms_norm(qr.data(), A.q_norm.data(), qr.data(), n, c.q_lora_rank, c.rms_norm_eps);
  const float* qr_in = linear_input(numerics_.act, qr.data(), n, c.q_lora_rank, qr_act);
  linear(qr_in, A.wq_b, q.data(), n);
  cpu::rms_norm(q.data(), nullptr, q.data(), n * H, hd, c.rms_norm_eps);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < H; ++h)
      cpu::rope_interleaved(&q[(size_t(t) * H + h) * hd + nope], rd, inv_freq, chunk.pos0 + t, false);
  trace("q", l, q.data(), n, H * hd);

  // 3.3 KV path (one head, K = V)
  std::vector<float> kv(size_t(n) * hd);
  linear(x_in, A.wkv, kv.data(), n);
  cpu::rms_norm(kv.data(), A.kv_norm.data(), kv.data(), n, hd, c.rms_norm_eps);
  for (int t = 0; t < n; ++t) {
    cpu::rope_interleaved(&kv[size_t(t) * hd + nope], rd, inv_freq, chunk.pos0 + t, false);
    cpu::round_kv(&kv[size_t(t) * hd], hd, rd, numerics_.kv);
  }
  trace("kv", l, kv.data(), n, hd);

  // 3.5 compressor: entries completed by this chunk become visible to its later queries.
  const int r = c.ratio(l);
  if (A.compressor) {
    const CompressorWeights& W = *A.compressor;
    advance_compressor(*S.compressor, W, x, n, chunk.pos0, D, S.compressed, S.n_compressed,
                       [&](float* entry, int b) {
                         cpu::rms_norm(entry, W.norm.data(), entry, 1, hd, c.rms_norm_eps);
                         cpu::rope_interleaved(entry + nope, rd, inv_freq, int64_t(b) * r, false);
                         cpu::round_kv(entry, hd, rd, numerics_.kv);
                       });
  }

  // 3.6 lightning indexer
  const int nh = c.index_n_heads, ihd = c.index_head_dim;
  std::vector<float> qi, wi;
  if (A.indexer) {
    const IndexerWeights& I = *A.indexer;
    advance_compressor(*S.index_compressor, I.compressor, x, n, chunk.pos0, D, S.index_keys, S.n_index_keys,
                       [&](float* entry, int b) {
                         cpu::rms_norm(entry, I.compressor.norm.data(), entry, 1, ihd, c.rms_norm_eps);
                         cpu::rope_interleaved(entry + ihd - rd, rd, inv_freq, int64_t(b) * r, false);
                         cpu::round_indexer(entry, ihd, numerics_.indexer);
                       });
    qi.resize(size_t(n) * nh * ihd);
    linear(qr_in, I.wq_b, qi.data(), n);
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < nh; ++h) {
        float* qh = &qi[(size_t(t) * nh + h) * ihd];
        cpu::rope_interleaved(qh + ihd - rd, rd, inv_freq, chunk.pos0 + t, false);
        cpu::round_indexer(qh, ihd, numerics_.indexer);
      }
    wi.resize(size_t(n) * nh);
    gemm_nt(x, I.weights_proj.data.data(), wi.data(), n, nh, D);
    const float w_scale = 1.0f / std::sqrt(float(ihd)) / std::sqrt(float(nh));
    for (float& v : wi) v *= w_scale;
  }

  // 3.7 per-query key selection: the window, then the selected (CSA) or all (HCA) visible compressed entries.
  // Entries are stored encoded (formats/kv_entry.h): the ones this chunk reads are decoded once, below.
  const int window = c.window;
  std::vector<std::vector<int>> picks(n);  // compressed entries of each query
  const std::vector<float> index_keys = A.indexer ? S.index_keys.decoded(0, S.n_index_keys) : std::vector<float>();
  // Threads only when the indexer's scores are worth waking them for: a short chunk (speculative verify) over a
  // short context is faster alone than with OpenMP's threads contending with OpenBLAS's for the cores.
  const int64_t index_work = A.indexer ? int64_t(n) * S.n_index_keys * nh * ihd : 0;
#pragma omp parallel for schedule(dynamic) if (n > 1 && index_work > (1 << 22))
  for (int t = 0; t < n; ++t) {
    if (!r) continue;
    const int n_visible = std::min<int>(int((chunk.pos0 + t + 1) / r), S.n_compressed);
    if (A.indexer) {
      std::vector<float> score(n_visible, 0.0f);
      for (int s = 0; s < n_visible; ++s) {
        const float* k = &index_keys[size_t(s) * ihd];
        float acc = 0;
        for (int h = 0; h < nh; ++h) {
          const float* qh = &qi[(size_t(t) * nh + h) * ihd];
          acc += wi[size_t(t) * nh + h] * std::max(cpu::dot(qh, k, ihd), 0.0f);
        }
        score[s] = acc;
      }
      picks[t] = cpu::top_k_indices(score, c.index_topk);
    } else {
      picks[t].resize(n_visible);
      std::iota(picks[t].begin(), picks[t].end(), 0);
    }
  }
  std::vector<int> decoded_row(S.n_compressed, -1);  // compressed entry -> its row in `compressed`
  int n_decoded = 0;
  for (const std::vector<int>& p : picks)
    for (int e : p)
      if (decoded_row[e] < 0) decoded_row[e] = n_decoded++;
  std::vector<float> compressed(size_t(n_decoded) * hd);
  for (int e = 0; e < S.n_compressed; ++e)
    if (decoded_row[e] >= 0) S.compressed.get(e, &compressed[size_t(decoded_row[e]) * hd]);
  const int64_t first_past = std::max<int64_t>(0, chunk.pos0 - window + 1);  // window positions of earlier chunks
  std::vector<float> past(size_t(chunk.pos0 - first_past) * hd);
  for (int64_t s = first_past; s < chunk.pos0; ++s)
    S.window.get(int(s % state.window_slots), &past[size_t(s - first_past) * hd]);

  std::vector<std::vector<const float*>> keys(n);
  int64_t total_keys = 0;
  for (int t = 0; t < n; ++t) {
    const int64_t p = chunk.pos0 + t;
    std::vector<const float*>& kt = keys[t];
    for (int64_t s = std::max<int64_t>(0, p - window + 1); s <= p; ++s)
      kt.push_back(s >= chunk.pos0 ? &kv[size_t(s - chunk.pos0) * hd] : &past[size_t(s - first_past) * hd]);
    for (int e : picks[t]) kt.push_back(&compressed[size_t(decoded_row[e]) * hd]);
    total_keys += int64_t(kt.size());
  }

  // 3.8 attention with sink, per (query, head); threads only when the work pays for them.
  std::vector<float> o(size_t(n) * H * hd);
  const float scale = 1.0f / std::sqrt(float(hd));
#pragma omp parallel for schedule(dynamic) if (total_keys * H * hd > (1 << 20))
  for (int th = 0; th < n * H; ++th) {
    const int t = th / H, h = th % H;
    const std::vector<const float*>& kt = keys[t];
    const float* qh = &q[(size_t(t) * H + h) * hd];
    std::vector<float> logit(kt.size());
    float mx = A.sink[h];  // the sink is a virtual key with zero value (denominator only)
    for (size_t j = 0; j < kt.size(); ++j) {
      logit[j] = cpu::dot(qh, kt[j], hd) * scale;
      mx = std::max(mx, logit[j]);
    }
    float denom = std::exp(A.sink[h] - mx);
    float* oh = &o[(size_t(t) * H + h) * hd];
    std::fill(oh, oh + hd, 0.0f);
    for (size_t j = 0; j < kt.size(); ++j) {
      const float e = std::exp(logit[j] - mx);
      denom += e;
      for (int i = 0; i < hd; ++i) oh[i] += e * kt[j][i];
    }
    for (int i = 0; i < hd; ++i) oh[i] /= denom;
    cpu::rope_interleaved(oh + nope, rd, inv_freq, chunk.pos0 + t, true);  // V carries RoPE: de-rotate at query pos
  }
  trace("attn_core", l, o.data(), n, H * hd);

  // 3.4 window ring: the last positions of this chunk.
  for (int t = std::max(0, n - state.window_slots); t < n; ++t)
    S.window.put(int((chunk.pos0 + t) % state.window_slots), &kv[size_t(t) * hd]);

  // 3.9 grouped low-rank output projection
  const int G = c.o_groups, group_width = H * hd / G, ol = c.o_lora_rank;
  std::vector<float> z(size_t(n) * G * ol);
  for (int g = 0; g < G; ++g)
    linear_rows(o.data() + size_t(g) * group_width, H * hd, A.wo_a, g * ol, ol, z.data() + size_t(g) * ol, G * ol, n);
  std::vector<float> z_act;
  linear(linear_input(numerics_.act, z.data(), n, G * ol, z_act), A.wo_b, out, n);
}

void Model::moe(int l, const float* x, const Chunk& chunk, float* out) const {
  const ModelConfig& c = config_;
  const MoEWeights& M = block(l).ffn;
  const int n = chunk.n(), D = c.hidden_size, E = c.n_routed_experts, k = c.n_experts_per_tok, I = c.moe_inter;

  // 4.1 router (fp32): scores from gate.weight; selection by hash table or by biased top-k.
  std::vector<float> logits(size_t(n) * E);
  gemm_nt(x, M.gate.data.data(), logits.data(), n, E, D);
  std::vector<std::vector<std::pair<int, float>>> routed(E);  // expert -> (token, weight)
  for (int t = 0; t < n; ++t) {
    float* s = &logits[size_t(t) * E];
    if (c.scoring == ScoringFunc::Softmax) {
      const float mx = *std::max_element(s, s + E);
      float sum = 0;
      for (int e = 0; e < E; ++e) sum += (s[e] = std::exp(s[e] - mx));
      for (int e = 0; e < E; ++e) s[e] /= sum;
    } else {
      for (int e = 0; e < E; ++e)
        s[e] = c.scoring == ScoringFunc::Sigmoid ? sigmoid(s[e]) : std::sqrt(cpu::softplus(s[e]));
    }
    std::vector<int> picks;
    if (c.hashed(l)) {
      const int32_t* row = &M.tid2eid[size_t(chunk.tokens[t]) * k];
      picks.assign(row, row + k);
    } else {
      std::vector<float> biased(s, s + E);
      for (int e = 0; e < E; ++e) biased[e] += M.gate_bias[e];
      picks = cpu::top_k_indices(biased, k);
    }
    float sum = 0;
    for (int e : picks) sum += s[e];
    for (int e : picks) {
      const float w = (c.norm_topk_prob ? s[e] / sum : s[e]) * c.routed_scaling_factor;
      routed[e].push_back({t, w});
    }
  }

  // 4.2 experts: SwiGLU with clamp (gate: upper only; up: both sides), routed weight before the down projection.
  const float limit = c.swiglu_limit;
  auto swiglu = [&](float* g, const float* u, int count) {
    for (int i = 0; i < count; ++i) {
      float gi = g[i], ui = u[i];
      if (limit > 0) {
        gi = std::min(gi, limit);
        ui = std::clamp(ui, -limit, limit);
      }
      g[i] = cpu::silu(gi) * ui;
    }
  };
  std::fill(out, out + size_t(n) * D, 0.0f);
  for (int e = 0; e < E; ++e) {
    const auto& tokens = routed[e];
    if (tokens.empty()) continue;
    const int m = int(tokens.size());
    std::vector<float> xs(size_t(m) * D), g(size_t(m) * I), u(size_t(m) * I), y(size_t(m) * D);
    for (int i = 0; i < m; ++i) std::copy_n(x + size_t(tokens[i].first) * D, D, &xs[size_t(i) * D]);
    const ExpertWeights& W = M.experts[e];
    std::vector<float> xs_act, g_act;
    const float* xs_in = linear_input(numerics_.act, xs.data(), m, D, xs_act);
    linear(xs_in, W.w1, g.data(), m);
    linear(xs_in, W.w3, u.data(), m);
    swiglu(g.data(), u.data(), m * I);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < I; ++j) g[size_t(i) * I + j] *= tokens[i].second;
    linear(linear_input(numerics_.act, g.data(), m, I, g_act), W.w2, y.data(), m);
    for (int i = 0; i < m; ++i)
      for (int d = 0; d < D; ++d) out[size_t(tokens[i].first) * D + d] += y[size_t(i) * D + d];
  }
  if (M.shared) {  // the shared expert is clamped too (current official revision)
    const int Is = M.shared->w1.rows;
    std::vector<float> g(size_t(n) * Is), u(size_t(n) * Is), x_act, g_act;
    const float* x_in = linear_input(numerics_.act, x, n, D, x_act);
    linear(x_in, M.shared->w1, g.data(), n);
    linear(x_in, M.shared->w3, u.data(), n);
    swiglu(g.data(), u.data(), n * Is);
    linear(linear_input(numerics_.act, g.data(), n, Is, g_act), M.shared->w2, out, n, /*accumulate=*/true);
  }
}

std::vector<float> Model::forward(SequenceState& state, std::span<const int32_t> tokens, bool last_only,
                                  std::vector<float>* final_streams) const {
  DSV4_CHECK(weights_.head.has_values() || weights_.head.packed,
             "the CPU forward needs the weights' values; this model holds shapes only (a synthetic benchmark model)");
  const ModelConfig& c = config_;
  const int n = int(tokens.size()), D = c.hidden_size, hc = c.hc_mult;
  DSV4_CHECK(n > 0, "forward: no tokens");
  DSV4_CHECK(state.n_tokens + n <= state.max_context,
             "sequence of {} tokens does not fit the context of {} tokens (--max-context)", state.n_tokens + n,
             state.max_context);
  for (int32_t id : tokens)
    DSV4_CHECK(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c.vocab_size);
  Chunk chunk{tokens, state.n_tokens};

  // 2.1 embedding, copied into hc identical streams
  std::vector<float> streams(size_t(n) * hc * D);
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < hc; ++k) std::copy_n(weights_.embed.row(tokens[t]), D, &streams[(size_t(t) * hc + k) * D]);
  trace("embed", -1, streams.data(), n, hc * D);

  for (int l = 0; l < c.n_layers; ++l) run_block(l, streams.data(), chunk, state.layers[size_t(l)], state);
  state.rollback_floor = std::max(state.n_tokens, state.n_tokens + n - kMaxRollback);
  state.n_tokens += n;
  if (final_streams) *final_streams = streams;
  return head_logits(weights_.hc_head, weights_.norm, streams.data(), n, last_only);
}

// One block (spec 2.3-2.4, 3, 4): mHC around attention, then around the MoE, on the chunk's streams [n, hc·D].
void Model::run_block(int l, float* streams, Chunk& chunk, LayerState& S, const SequenceState& state) const {
  const ModelConfig& c = config_;
  const LayerWeights& L = block(l);
  const int n = chunk.n(), D = c.hidden_size, hc = c.hc_mult;
  std::vector<float> collapsed(size_t(n) * D), normed(size_t(n) * D), out(size_t(n) * D);
  std::vector<float> post(size_t(n) * hc), comb(size_t(n) * hc * hc);
  hc_pre(L.hc_attn, c, streams, n, collapsed.data(), post.data(), comb.data());
  cpu::rms_norm(collapsed.data(), L.attn_norm.data(), normed.data(), n, D, c.rms_norm_eps);
  trace("attn_norm", l, normed.data(), n, D);
  attention(l, normed.data(), chunk, S, state, out.data());
  trace("attn_out", l, out.data(), n, D);
  hc_post(c, out.data(), post.data(), comb.data(), n, streams);

  hc_pre(L.hc_ffn, c, streams, n, collapsed.data(), post.data(), comb.data());
  cpu::rms_norm(collapsed.data(), L.ffn_norm.data(), normed.data(), n, D, c.rms_norm_eps);
  trace("ffn_norm", l, normed.data(), n, D);
  moe(l, normed.data(), chunk, out.data());
  trace("ffn_out", l, out.data(), n, D);
  hc_post(c, out.data(), post.data(), comb.data(), n, streams);
  trace("streams", l, streams, n, hc * D);
}

// 5: final collapse, norm, head, for the rows asked for (all, or the last).
std::vector<float> Model::head_logits(const HyperConnWeights& collapse, const Vector& norm, const float* streams,
                                      int n, bool last_only) const {
  const ModelConfig& c = config_;
  const int D = c.hidden_size, hc = c.hc_mult;
  const int first = last_only ? n - 1 : 0, rows = n - first;
  std::vector<float> y(size_t(rows) * D);
  hc_head(collapse, c, streams + size_t(first) * hc * D, rows, y.data());
  cpu::rms_norm(y.data(), norm.data(), y.data(), rows, D, c.rms_norm_eps);
  trace("final_norm", -1, y.data(), rows, D);
  std::vector<float> logits(size_t(rows) * c.vocab_size);
  linear(y.data(), weights_.head, logits.data(), rows);
  return logits;
}

std::vector<float> Model::mtp_forward(SequenceState& state, const float* main_streams,
                                      std::span<const int32_t> next_tokens, bool last_only) const {
  DSV4_CHECK(weights_.mtp && state.mtp, "mtp_forward: the model was loaded without its MTP block");
  const ModelConfig& c = config_;
  const MtpWeights& m = *weights_.mtp;
  const int n = int(next_tokens.size()), D = c.hidden_size, hc = c.hc_mult;
  DSV4_CHECK(n > 0, "mtp_forward: no tokens");
  DSV4_CHECK(state.mtp_tokens + n <= state.n_tokens,
             "mtp_forward: positions {}..{} are past the {} tokens the main model consumed", state.mtp_tokens,
             state.mtp_tokens + n - 1, state.n_tokens);
  for (int32_t id : next_tokens)
    DSV4_CHECK(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary [0, {})", id, c.vocab_size);
  const int l = c.n_layers;  // the MTP block's index in traces and in ModelConfig's per-layer accessors

  // X' = e_proj(RMSNorm(embed(next); enorm)) on every stream + h_proj(RMSNorm(X_k; hnorm)) per stream k
  std::vector<float> e(size_t(n) * D), e_proj(size_t(n) * D), act;
  for (int t = 0; t < n; ++t) std::copy_n(weights_.embed.row(next_tokens[t]), D, &e[size_t(t) * D]);
  cpu::rms_norm(e.data(), m.enorm.data(), e.data(), n, D, c.rms_norm_eps);
  linear(linear_input(numerics_.act, e.data(), n, D, act), m.e_proj, e_proj.data(), n);
  std::vector<float> h(size_t(n) * hc * D), streams(size_t(n) * hc * D);
  cpu::rms_norm(main_streams, m.hnorm.data(), h.data(), n * hc, D, c.rms_norm_eps);
  linear(linear_input(numerics_.act, h.data(), n * hc, D, act), m.h_proj, streams.data(), n * hc);
  for (int t = 0; t < n; ++t)
    for (int k = 0; k < hc; ++k)
      for (int d = 0; d < D; ++d) streams[(size_t(t) * hc + k) * D + d] += e_proj[size_t(t) * D + d];
  trace("mtp_in", l, streams.data(), n, hc * D);

  Chunk chunk{next_tokens, state.mtp_tokens};
  run_block(l, streams.data(), chunk, *state.mtp, state);
  state.mtp_tokens += n;
  return head_logits(m.hc_head, m.norm, streams.data(), n, last_only);
}

}  // namespace dsv4
