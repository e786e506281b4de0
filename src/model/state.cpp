// SPDX-License-Identifier: MIT
#include "model/state.h"

#include <algorithm>
#include <limits>

#include "core/check.h"

namespace dsv4 {

void CompressorState::reset() {
  std::fill(kv.begin(), kv.end(), 0.0f);
  std::fill(score.begin(), score.end(), -std::numeric_limits<float>::infinity());
  undo.clear();
}

void CompressorState::remember(int64_t pos, int first_row, int n_rows) {
  const auto begin = size_t(first_row) * width, end = begin + size_t(n_rows) * width;
  undo.push_back({pos, first_row, n_rows, std::vector<float>(kv.begin() + begin, kv.begin() + end),
                  std::vector<float>(score.begin() + begin, score.begin() + end)});
}

void CompressorState::undo_from(int64_t pos) {
  while (!undo.empty() && undo.back().pos >= pos) {
    const Overwritten& o = undo.back();
    std::copy(o.kv.begin(), o.kv.end(), kv.begin() + size_t(o.first_row) * width);
    std::copy(o.score.begin(), o.score.end(), score.begin() + size_t(o.first_row) * width);
    undo.pop_back();
  }
}

KvEntries KvEntries::create(KvCodec codec, int rows, int dim, int rope) {
  DSV4_CHECK(codec != KvCodec::Fp8 || (dim - rope) % kKvFp8Block == 0,
             "FP8 KV entries need the nope dims ({}) to be a multiple of {}", dim - rope, kKvFp8Block);
  DSV4_CHECK(codec != KvCodec::Fp4 || dim % kKvFp4Block == 0,
             "FP4 indexer entries need index_head_dim ({}) to be a multiple of {}", dim, kKvFp4Block);
  KvEntries e;
  e.codec = codec;
  e.dim = dim;
  e.rope = rope;
  e.row_bytes = kv_entry_bytes(codec, dim, rope);
  e.bytes.resize(size_t(rows) * e.row_bytes);
  return e;
}

void KvEntries::put(int row, const float* values) {
  encode_kv_entry(codec, values, dim, rope, &bytes[size_t(row) * row_bytes]);
}

void KvEntries::get(int row, float* values) const {
  decode_kv_entry(codec, &bytes[size_t(row) * row_bytes], dim, rope, values);
}

std::vector<float> KvEntries::decoded(int first, int n) const {
  std::vector<float> out(size_t(n) * dim);
  for (int i = 0; i < n; ++i) get(first + i, &out[size_t(i) * dim]);
  return out;
}

static CompressorState make_compressor(int ratio, int dim, bool overlap) {
  CompressorState s;
  s.ratio = ratio;
  s.dim = dim;
  s.overlap = overlap;
  s.rows = (overlap ? 2 : 1) * ratio;
  s.width = (overlap ? 2 : 1) * dim;
  s.kv.resize(size_t(s.rows) * s.width);
  s.score.resize(size_t(s.rows) * s.width);
  s.reset();
  return s;
}

SequenceState SequenceState::create(const ModelConfig& c, int max_context, bool mtp, StateCodecs codecs) {
  DSV4_CHECK(max_context > 0, "--max-context must be positive, got {}", max_context);
  SequenceState s;
  s.max_context = max_context;
  s.window_slots = std::min(c.window + kMaxRollback, max_context);
  s.layers.resize(c.n_layers);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerState& L = s.layers[l];
    L.window = KvEntries::create(codecs.kv, s.window_slots, c.head_dim, c.rope_dim);
    if (!c.has_compressor(l)) continue;
    const int r = c.compress_ratio[l], max_entries = max_context / r;
    L.compressed = KvEntries::create(codecs.kv, max_entries, c.head_dim, c.rope_dim);
    L.compressor = make_compressor(r, c.head_dim, c.is_csa(l));
    if (c.is_csa(l)) {
      L.index_keys = KvEntries::create(codecs.index, max_entries, c.index_head_dim, 0);
      L.index_compressor = make_compressor(r, c.index_head_dim, true);
    }
  }
  if (mtp) {
    s.mtp.emplace();
    s.mtp->window = KvEntries::create(codecs.kv, s.window_slots, c.head_dim, c.rope_dim);
  }
  return s;
}

void SequenceState::reset() {
  n_tokens = 0;
  rollback_floor = 0;
  mtp_tokens = 0;
  for (LayerState& L : layers) {
    L.n_compressed = 0;
    L.n_index_keys = 0;
    if (L.compressor) L.compressor->reset();
    if (L.index_compressor) L.index_compressor->reset();
  }
}

void SequenceState::rollback(int64_t n) {
  DSV4_CHECK(n >= rollback_floor && n <= n_tokens,
             "rollback to {} tokens: only the last forward's tokens can be forgotten ({} .. {})", n, rollback_floor,
             n_tokens);
  for (LayerState& L : layers) {
    if (!L.compressor) continue;
    L.compressor->undo_from(n);
    L.n_compressed = int(n / L.compressor->ratio);  // entry b is complete once position b·r + r - 1 is consumed
    if (L.index_compressor) {
      L.index_compressor->undo_from(n);
      L.n_index_keys = L.n_compressed;
    }
  }
  n_tokens = n;
  // The MTP block only has a window ring, whose slots past n are never read again (as the main model's).
  mtp_tokens = std::min(mtp_tokens, n);
}

size_t SequenceState::bytes() const {
  size_t b = 0;
  if (mtp) b += mtp->window.bytes.size();
  for (const LayerState& L : layers) {
    b += L.window.bytes.size() + L.compressed.bytes.size() + L.index_keys.bytes.size();
    for (const auto* cs : {&L.compressor, &L.index_compressor})
      if (*cs) b += ((*cs)->kv.size() + (*cs)->score.size()) * sizeof(float);
  }
  return b;
}

}  // namespace dsv4
