// SPDX-License-Identifier: MIT
// Per-sequence decode state, preallocated once from --max-context with the exact size each layer type needs
// (spec 6): the sliding-window ring, the compressed KV entries, the indexer keys (CSA), and the compressors'
// partial-block state in the reference layout (spec 3.5). Nothing is allocated while decoding.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "model/config.h"

namespace dsv4 {

// Partial block of one compressor: `rows` = c·r token rows of `width` = c·d_c channels (c = 2 if overlapped).
// Overlapped: rows 0..r-1 hold the previous complete block (only its first d_c channels are read), rows
// r..2r-1 the current block. Plain: rows 0..r-1 the current block.
struct CompressorState {
  int ratio = 0, dim = 0, rows = 0, width = 0;
  bool overlap = false;
  std::vector<float> kv;     // [rows, width], 0 at sequence start
  std::vector<float> score;  // [rows, width] gate logits incl. ape, -inf at sequence start
  void reset();
};

struct LayerState {
  std::vector<float> window;      // [window_slots, head_dim]; position p lives in slot p % window_slots
  std::vector<float> compressed;  // [max_entries, head_dim]; entry b pools tokens b·r .. b·r+r-1
  std::vector<float> index_keys;  // [max_entries, index_head_dim] (CSA)
  std::optional<CompressorState> compressor, index_compressor;
  int n_compressed = 0;           // entries emitted so far
  int n_index_keys = 0;           // indexer entries (same blocks, so equal to n_compressed after each step)
};

struct SequenceState {
  int max_context = 0;
  int window_slots = 0;
  int64_t n_tokens = 0;  // tokens consumed so far = position of the next token
  std::vector<LayerState> layers;

  static SequenceState create(const ModelConfig& config, int max_context);
  void reset();          // start a new sequence (compressor scores back to -inf: spec 3.5)
  size_t bytes() const;  // bytes held by the state
};

}  // namespace dsv4
