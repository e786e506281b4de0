// SPDX-License-Identifier: MIT
// Per-sequence decode state, preallocated once from --max-context with the exact size each layer type needs
// (spec 6): the sliding-window ring, the compressed KV entries, the indexer keys (CSA), and the compressors'
// partial-block state in the reference layout (spec 3.5). Nothing is allocated while decoding.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

#include "formats/kv_entry.h"
#include "model/config.h"

namespace dsv4 {

// Speculative decoding verifies drafted tokens in one forward and then forgets the rejected ones
// (SequenceState::rollback): at most this many of the last forward's tokens.
constexpr int kMaxRollback = 16;

// Partial block of one compressor: `rows` = c·r token rows of `width` = c·d_c channels (c = 2 if overlapped).
// Overlapped: rows 0..r-1 hold the previous complete block (only its first d_c channels are read), rows
// r..2r-1 the current block. Plain: rows 0..r-1 the current block.
struct CompressorState {
  int ratio = 0, dim = 0, rows = 0, width = 0;
  bool overlap = false;
  std::vector<float> kv;     // [rows, width], 0 at sequence start
  std::vector<float> score;  // [rows, width] gate logits incl. ape, -inf at sequence start

  // Rows as they were before position `pos` overwrote them (its own row, or the previous block's rows when it
  // completed an overlapped block), for the last forward's final kMaxRollback positions: undone newest first,
  // they give back the state before any of those positions. The window ring and the entries need no undo (the
  // ring has kMaxRollback slots more than the window, so a forgotten position's slot held a key outside the window
  // of every query still to come; entries past the kept count are never read).
  struct Overwritten {
    int64_t pos;
    int first_row, n_rows;
    std::vector<float> kv, score;
  };
  std::vector<Overwritten> undo;
  void remember(int64_t pos, int first_row, int n_rows);  // call before the rows change
  void undo_from(int64_t pos);                            // puts back what positions >= pos overwrote
  void reset();
};

// Rows of KV-cache entries in the bytes of one codec of formats/kv_entry.h.
struct KvEntries {
  KvCodec codec = KvCodec::F32;
  int dim = 0, rope = 0, row_bytes = 0;
  std::vector<uint8_t> bytes;  // [rows, row_bytes]

  static KvEntries create(KvCodec codec, int rows, int dim, int rope);
  int rows() const { return row_bytes ? int(bytes.size() / size_t(row_bytes)) : 0; }
  // Stores the values' rounding for the codec: lossless for values already rounded (cpu::round_kv and
  // cpu::round_indexer of the matching storage).
  void put(int row, const float* values);
  void get(int row, float* values) const;
  // Rows first .. first + n - 1 as floats, [n, dim].
  std::vector<float> decoded(int first, int n) const;
};

// How the state stores its entries: the default is what the reference's rounding makes lossless (Numerics
// kv = fp8, indexer = fp4); F32 for both keeps the floats the CUDA runner keeps.
struct StateCodecs {
  KvCodec kv = KvCodec::F32, index = KvCodec::F32;
};

struct LayerState {
  KvEntries window;      // [window_slots, head_dim]; position p lives in slot p % window_slots
  KvEntries compressed;  // [max_entries, head_dim]; entry b pools tokens b·r .. b·r+r-1
  KvEntries index_keys;  // [max_entries, index_head_dim] (CSA)
  std::optional<CompressorState> compressor, index_compressor;
  int n_compressed = 0;           // entries emitted so far
  int n_index_keys = 0;           // indexer entries (same blocks, so equal to n_compressed after each step)
};

struct SequenceState {
  int max_context = 0;
  int window_slots = 0;  // the window + kMaxRollback (or max_context when smaller)
  int64_t n_tokens = 0;  // tokens consumed so far = position of the next token
  std::vector<LayerState> layers;

  int64_t rollback_floor = 0;  // rollback() can go back to any position from here to n_tokens
  std::optional<LayerState> mtp;  // the MTP block's window ring (models loaded with it)
  int64_t mtp_tokens = 0;         // positions the MTP block consumed (<= n_tokens)

  static SequenceState create(const ModelConfig& config, int max_context, bool mtp = false, StateCodecs codecs = {});
  void reset();          // start a new sequence (compressor scores back to -inf: spec 3.5)
  // Forgets the tokens at positions >= n: only tokens of the last forward, at most kMaxRollback of them
  // (rollback_floor <= n <= n_tokens). The state is then what a forward over the first n tokens left.
  void rollback(int64_t n);
  size_t bytes() const;  // bytes held by the state
};

}  // namespace dsv4
