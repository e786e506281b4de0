// SPDX-License-Identifier: MIT
#include "tokenizer/bpe.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/check.h"
#include "tokenizer/utf8.h"

namespace dsv4 {

const std::array<char32_t, 256>& byte_to_unicode() {
  static const std::array<char32_t, 256> table = [] {
    std::array<char32_t, 256> t{};
    // Printable Latin-1 bytes keep their code point; the other 68 bytes take 256, 257, ... in order.
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return t;
  }();
  return table;
}

namespace {
std::atomic<uint64_t> g_next_serial{1};

// Inverse of byte_to_unicode: code points 0..323 -> byte, -1 elsewhere.
const std::array<int16_t, 324>& unicode_to_byte() {
  static const std::array<int16_t, 324> table = [] {
    std::array<int16_t, 324> t;
    t.fill(-1);
    const auto& fwd = byte_to_unicode();
    for (int b = 0; b < 256; ++b) t[fwd[b]] = static_cast<int16_t>(b);
    return t;
  }();
  return table;
}
}  // namespace

std::optional<std::string> byte_level_to_bytes(std::string_view spelling) {
  const auto& inv = unicode_to_byte();
  std::string out;
  for (size_t i = 0; i < spelling.size();) {
    const utf8::Step st = utf8::next(spelling.substr(i));
    if (st.kind != utf8::Step::kValid || st.code_point >= inv.size() || inv[st.code_point] < 0) return std::nullopt;
    out.push_back(static_cast<char>(inv[st.code_point]));
    i += st.len;
  }
  return out;
}

BpeModel::BpeModel(BpeModel&& o) noexcept
    : vocab_(std::move(o.vocab_)),
      spellings_(std::move(o.spellings_)),
      byte_id_(o.byte_id_),
      merges_(std::move(o.merges_)),
      ignore_merges_(o.ignore_merges_),
      raw_vocab_(std::move(o.raw_vocab_)),
      serial_(o.serial_) {}

BpeModel& BpeModel::operator=(BpeModel&& o) noexcept {
  vocab_ = std::move(o.vocab_);
  spellings_ = std::move(o.spellings_);
  byte_id_ = o.byte_id_;
  merges_ = std::move(o.merges_);
  ignore_merges_ = o.ignore_merges_;
  raw_vocab_ = std::move(o.raw_vocab_);
  serial_ = o.serial_;
  return *this;
}

BpeModel BpeModel::from_json(const nlohmann::json& model) {
  DSV4_CHECK(model.is_object() && model.value("type", "") == "BPE",
             "tokenizer.json: model.type must be \"BPE\" (byte-level BPE), got {}",
             model.is_object() ? model.value("type", "<missing>") : model.type_name());
  DSV4_CHECK(!model.contains("dropout") || model["dropout"].is_null(), "tokenizer.json: BPE dropout is not supported");
  DSV4_CHECK(!model.value("byte_fallback", false), "tokenizer.json: BPE byte_fallback is not supported");
  DSV4_CHECK(!model.contains("unk_token") || model["unk_token"].is_null(),
             "tokenizer.json: BPE unk_token is not supported (byte-level BPE needs none)");
  for (const char* field : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    DSV4_CHECK(!model.contains(field) || model[field].is_null() || model[field] == "",
               "tokenizer.json: BPE {} is not supported", field);
  }

  BpeModel m;
  m.serial_ = g_next_serial.fetch_add(1);
  m.ignore_merges_ = model.value("ignore_merges", false);
  const auto& vocab = model.at("vocab");
  DSV4_CHECK(vocab.is_object(), "tokenizer.json: model.vocab must be an object");
  int32_t max_id = -1;
  m.vocab_.reserve(vocab.size());
  for (const auto& [spelling, id_json] : vocab.items()) {
    const int32_t id = id_json.get<int32_t>();
    DSV4_CHECK(id >= 0, "tokenizer.json: model.vocab[{}] has negative id {}", spelling, id);
    m.vocab_.emplace(spelling, id);
    max_id = std::max(max_id, id);
  }
  m.spellings_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [spelling, id] : m.vocab_) m.spellings_[id] = spelling;

  const auto& fwd = byte_to_unicode();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    utf8::append(s, fwd[b]);
    auto it = m.vocab_.find(s);
    m.byte_id_[b] = it == m.vocab_.end() ? -1 : it->second;
  }
  if (m.ignore_merges_) {
    for (const auto& [spelling, id] : m.vocab_) {
      if (auto raw = byte_level_to_bytes(spelling)) m.raw_vocab_.emplace(*raw, id);
    }
  }

  const auto& merges = model.at("merges");
  DSV4_CHECK(merges.is_array(), "tokenizer.json: model.merges must be an array");
  std::unordered_map<uint64_t, Merge> merge_map;
  merge_map.reserve(merges.size());
  auto lookup = [&](const std::string& s, size_t rank) {
    auto it = m.vocab_.find(s);
    DSV4_CHECK(it != m.vocab_.end(), "tokenizer.json: merge #{} uses `{}`, which is not in model.vocab", rank, s);
    return it->second;
  };
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& e = merges[rank];
    std::string a, b;
    if (e.is_string()) {
      const std::string& s = e.get_ref<const std::string&>();
      const size_t sp = s.find(' ');
      DSV4_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                 "tokenizer.json: merge #{} `{}` must be two tokens separated by one space", rank, s);
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else {
      DSV4_CHECK(e.is_array() && e.size() == 2, "tokenizer.json: merge #{} must be \"a b\" or [a, b]", rank);
      a = e[0].get<std::string>(), b = e[1].get<std::string>();
    }
    // Later duplicates overwrite earlier ones, as HF's HashMap collect does.
    merge_map.insert_or_assign(pair_key(lookup(a, rank), lookup(b, rank)),
                               Merge{static_cast<int32_t>(rank), lookup(a + b, rank)});
  }
  m.merges_.build(merge_map);
  return m;
}

void BpeModel::MergeTable::build(const std::unordered_map<uint64_t, Merge>& merges) {
  size_t capacity = 16;
  shift = 60;
  while (capacity < 2 * merges.size()) capacity *= 2, --shift;
  slots.assign(capacity, Slot{kEmpty, Merge{0, 0}});
  for (const auto& [key, merge] : merges) {
    size_t i = (key * 0x9E3779B97F4A7C15ull) >> shift;
    while (slots[i].key != kEmpty) i = (i + 1) & (capacity - 1);
    slots[i] = Slot{key, merge};
  }
}

std::optional<int32_t> BpeModel::find(std::string_view spelling) const {
  auto it = vocab_.find(std::string(spelling));
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

namespace {

// A per-thread, direct-mapped cache of short words (HF keeps a word cache too): most pre-tokens of
// real text repeat, and a hit skips the merge loop. Collisions simply overwrite; no locks.
struct WordCache {
  static constexpr size_t kSlots = 1 << 14;
  static constexpr size_t kMaxWordBytes = 38;
  static constexpr size_t kMaxIds = 14;
  struct Slot {
    uint64_t hash = 0;
    uint8_t len = 0, n_ids = 0;
    char key[kMaxWordBytes];
    int32_t ids[kMaxIds];
  };
  uint64_t owner = 0;  // serial of the BpeModel the slots belong to
  std::vector<Slot> slots;
};

uint64_t hash_word(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h | 1;  // never 0, the empty slot's hash
}

}  // namespace

void BpeModel::encode(std::string_view piece, std::vector<int32_t>& ids) const {
  if (piece.empty()) return;
  if (piece.size() > WordCache::kMaxWordBytes) {
    merge_word(piece, ids);
    return;
  }
  thread_local WordCache cache;
  if (cache.owner != serial_) {
    cache.slots.assign(WordCache::kSlots, WordCache::Slot{});
    cache.owner = serial_;
  }
  const uint64_t h = hash_word(piece);
  WordCache::Slot& slot = cache.slots[h & (WordCache::kSlots - 1)];
  if (slot.hash == h && slot.len == piece.size() && std::memcmp(slot.key, piece.data(), piece.size()) == 0) {
    ids.insert(ids.end(), slot.ids, slot.ids + slot.n_ids);
    return;
  }
  const size_t first = ids.size();
  merge_word(piece, ids);
  const size_t n = ids.size() - first;
  if (n <= WordCache::kMaxIds) {
    slot.hash = h;
    slot.len = static_cast<uint8_t>(piece.size());
    slot.n_ids = static_cast<uint8_t>(n);
    std::memcpy(slot.key, piece.data(), piece.size());
    std::copy(ids.begin() + first, ids.end(), slot.ids);
  }
}

void BpeModel::merge_word(std::string_view piece, std::vector<int32_t>& ids) const {
  if (ignore_merges_) {
    auto it = raw_vocab_.find(std::string(piece));
    if (it != raw_vocab_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  // Doubly linked symbols; a merged-away symbol gets len 0. Bytes missing from the vocabulary are
  // dropped, as HF does when there is no unk token.
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    int32_t len;
  };
  struct Candidate {
    int32_t rank, pos, new_id;
    // Min-heap order on (rank, pos): the lowest rank first, leftmost among equal ranks.
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  // Per-thread scratch, reused across words to keep the allocator out of the loop.
  thread_local std::vector<Symbol> sym;
  thread_local std::vector<Candidate> heap;
  sym.clear();
  heap.clear();
  for (unsigned char b : piece) {
    const int32_t id = byte_id_[b];
    if (id < 0) continue;
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, n + 1, 1});
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  auto push = [&](const Merge* m, int32_t pos) {
    heap.push_back({m->rank, pos, m->new_id});
    std::push_heap(heap.begin(), heap.end(), std::greater<Candidate>());
  };
  auto find_merge = [&](int32_t a, int32_t b) { return merges_.find(pair_key(a, b)); };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) {
    if (const Merge* m = find_merge(sym[i].id, sym[i + 1].id)) push(m, i);
  }
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Candidate>());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next < 0) continue;
    const int32_t next_pos = cur.next;
    // A stale entry: the pair at this position changed since it was queued.
    const Merge* now = find_merge(cur.id, sym[next_pos].id);
    if (!now || now->new_id != top.new_id) continue;

    cur.id = top.new_id;
    cur.len += sym[next_pos].len;
    cur.next = sym[next_pos].next;
    sym[next_pos].len = 0;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;

    if (cur.prev >= 0) {
      if (const Merge* m = find_merge(sym[cur.prev].id, cur.id)) push(m, cur.prev);
    }
    if (cur.next >= 0) {
      if (const Merge* m = find_merge(cur.id, sym[cur.next].id)) push(m, top.pos);
    }
  }
  for (const Symbol& s : sym) {
    if (s.len != 0) ids.push_back(s.id);
  }
}

}  // namespace dsv4
