// SPDX-License-Identifier: MIT
// Byte-level BPE model (HF tokenizers `BPE` with the GPT-2 byte<->unicode alphabet).
//
// The vocabulary in tokenizer.json spells every byte as a printable code point (space is "Ġ",
// 0x0A is "Ċ", ...). This model works on raw bytes instead: a pre-token's bytes are the initial
// symbols and merges are looked up by (left id, right id). The merge loop reproduces HF's
// `Word::merge_all` exactly: a min-heap on (rank, position) whose stale entries are recognised by
// the id the pair would produce, which is what makes the output bit-identical even for
// vocabularies where two different pairs produce the same token.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dsv4 {

// GPT-2's reversible byte -> code point map (printable bytes map to themselves).
const std::array<char32_t, 256>& byte_to_unicode();

// Maps a byte-level token spelling back to bytes; nullopt when a code point is outside the map
// (then HF's ByteLevel decoder uses the spelling's own UTF-8 bytes).
std::optional<std::string> byte_level_to_bytes(std::string_view spelling);

class BpeModel {
 public:
  // Reads the tokenizer.json "model" object (type BPE, merges as "a b" strings or [a, b] pairs).
  static BpeModel from_json(const nlohmann::json& model);

  BpeModel() = default;
  BpeModel(BpeModel&& o) noexcept;
  BpeModel& operator=(BpeModel&& o) noexcept;

  // Appends the ids of one pre-token (raw bytes). Thread-safe.
  void encode(std::string_view piece, std::vector<int32_t>& ids) const;

  // Number of vocabulary entries and the id -> spelling table ("" for holes).
  int32_t size() const { return static_cast<int32_t>(spellings_.size()); }
  const std::string& spelling(int32_t id) const { return spellings_[id]; }
  std::optional<int32_t> find(std::string_view spelling) const;

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  void merge_word(std::string_view piece, std::vector<int32_t>& ids) const;

  std::unordered_map<std::string, int32_t> vocab_;  // byte-level spelling -> id
  std::vector<std::string> spellings_;              // id -> byte-level spelling
  std::array<int32_t, 256> byte_id_{};               // id of each single byte, -1 when absent
  // (left id, right id) -> merge, in an open-addressing table: the lookup is the hot loop of BPE.
  struct MergeTable {
    static constexpr uint64_t kEmpty = ~uint64_t{0};
    struct Slot {
      uint64_t key;  // pair_key(left, right), kEmpty when unused
      Merge merge;
    };
    std::vector<Slot> slots;  // key and value side by side: one cache line per probe
    int shift = 64;
    void build(const std::unordered_map<uint64_t, Merge>& merges);
    const Merge* find(uint64_t key) const {
      if (slots.empty()) return nullptr;
      const size_t mask = slots.size() - 1;
      for (size_t i = (key * 0x9E3779B97F4A7C15ull) >> shift;; i = (i + 1) & mask) {
        if (slots[i].key == key) return &slots[i].merge;
        if (slots[i].key == kEmpty) return nullptr;
      }
    }
  };
  MergeTable merges_;
  bool ignore_merges_ = false;
  std::unordered_map<std::string, int32_t> raw_vocab_;  // raw bytes -> id (only for ignore_merges)

  // Each BpeModel gets a serial number so per-thread word caches (bpe.cpp) can tell models apart.
  uint64_t serial_ = 0;
};

}  // namespace dsv4
