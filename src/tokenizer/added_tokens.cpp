// SPDX-License-Identifier: MIT
#include "tokenizer/added_tokens.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>

#include "core/check.h"
#include "tokenizer/bpe.h"
#include "tokenizer/utf8.h"

namespace dsv4 {

namespace {

// Unicode White_Space (what Rust's regex `\s` matches in HF's lstrip/rstrip helpers).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Rust regex's Unicode `\w`: Alphabetic, M, Nd, Pc, Join_Control. Only single_word tokens need it.
bool is_word_char(char32_t c) {
  static pcre2_code* const code = [] {
    const std::string_view pat = R"(^[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])";
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* p = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), PCRE2_UTF | PCRE2_UCP,
                                  &err, &off, nullptr);
    DSV4_CHECK(p, "internal: the word-character regex does not compile with this PCRE2 (error {})", err);
    return p;
  }();
  std::string s;
  utf8::append(s, c);
  thread_local pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  return pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, md, nullptr) >= 0;
}

// Code point that ends s (s valid UTF-8 and not empty).
char32_t last_code_point(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
  return utf8::next(s.substr(i)).code_point;
}

// Start of the run of white space that ends s.
size_t trailing_space_start(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t i = end - 1;
    while (i > 0 && (static_cast<uint8_t>(s[i]) & 0xC0) == 0x80) --i;
    if (!is_white_space(utf8::next(s.substr(i)).code_point)) break;
    end = i;
  }
  return end;
}

// Length of the run of white space that starts s.
size_t leading_space_length(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const utf8::Step st = utf8::next(s.substr(i));
    if (!is_white_space(st.code_point)) break;
    i += st.len;
  }
  return i;
}

}  // namespace

void AddedVocabulary::Trie::insert(std::string_view s, int32_t token) {
  int32_t node = 0;
  for (unsigned char b : s) {
    auto& ch = nodes[node].children;
    auto it = std::find_if(ch.begin(), ch.end(), [b](const auto& e) { return e.first == b; });
    if (it != ch.end()) {
      node = it->second;
    } else {
      const auto fresh = static_cast<int32_t>(nodes.size());
      nodes[node].children.emplace_back(b, fresh);
      nodes.emplace_back();
      node = fresh;
    }
  }
  if (nodes[node].token < 0) nodes[node].token = token;  // the first declaration wins a tie
  first_byte[static_cast<unsigned char>(s[0])] = true;
}

size_t AddedVocabulary::Trie::longest(std::string_view text, size_t pos, int32_t& token) const {
  token = -1;
  size_t best_end = 0;
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto b = static_cast<unsigned char>(text[i]);
    const auto& ch = nodes[node].children;
    auto it = std::find_if(ch.begin(), ch.end(), [b](const auto& e) { return e.first == b; });
    if (it == ch.end()) break;
    node = it->second;
    if (nodes[node].token >= 0) token = nodes[node].token, best_end = i + 1;
  }
  return best_end;
}

AddedVocabulary AddedVocabulary::from_json(const nlohmann::json& added_tokens, const BpeModel& model) {
  AddedVocabulary v;
  if (added_tokens.is_null()) return v;
  DSV4_CHECK(added_tokens.is_array(), "tokenizer.json: added_tokens must be an array");
  int32_t max_added_id = -1;
  std::vector<int32_t> trie_order_special, trie_order_plain;
  for (const auto& j : added_tokens) {
    AddedToken t;
    t.content = j.at("content").get<std::string>();
    t.special = j.value("special", false);
    t.normalized = j.value("normalized", !t.special);
    t.lstrip = j.value("lstrip", false);
    t.rstrip = j.value("rstrip", false);
    t.single_word = j.value("single_word", false);
    if (t.content.empty()) continue;
    DSV4_CHECK(utf8::is_valid(t.content), "tokenizer.json: added token #{} is not valid UTF-8", v.tokens_.size());
    // HF ignores a repeated content, except that a later special declaration makes it special.
    if (auto it = v.index_.find(t.content); it != v.index_.end()) {
      AddedToken& old = v.tokens_[it->second];
      if (t.special && !old.special) {
        t.id = old.id;
        old = t;
        std::erase(trie_order_plain, it->second);
        trie_order_special.push_back(it->second);
      }
      continue;
    }
    if (auto id = model.find(t.content)) {
      t.id = *id;
    } else if (max_added_id < 0) {
      t.id = model.size();
    } else {
      t.id = max_added_id >= model.size() ? max_added_id + 1 : model.size();
    }
    if (j.contains("id") && j["id"].is_number_integer() && j["id"].get<int64_t>() != t.id) {
      spdlog::warn("tokenizer.json: added token `{}` declares id {} but gets id {} (HF assigns ids in order)",
                   t.content, j["id"].get<int64_t>(), t.id);
    }
    max_added_id = std::max(max_added_id, t.id);
    const auto index = static_cast<int32_t>(v.tokens_.size());
    (t.special ? trie_order_special : trie_order_plain).push_back(index);
    v.index_.emplace(t.content, index);
    v.tokens_.push_back(std::move(t));
  }
  // HF lists special tokens first when it builds its two automata.
  for (const auto* order : {&trie_order_special, &trie_order_plain}) {
    for (int32_t index : *order) {
      const AddedToken& t = v.tokens_[index];
      (t.normalized ? v.normalized_trie_ : v.raw_trie_).insert(t.content, index);
    }
  }
  return v;
}

const AddedToken* AddedVocabulary::find(std::string_view content) const {
  auto it = index_.find(std::string(content));
  return it == index_.end() ? nullptr : &tokens_[it->second];
}

void AddedVocabulary::split_pass(std::string_view text, size_t begin, size_t end, const Trie& trie,
                                 bool allow_special, std::vector<Segment>& out) const {
  const std::string_view s = text.substr(0, end);
  size_t start_offset = begin;
  for (size_t i = begin; i < end;) {
    if (!trie.first_byte[static_cast<unsigned char>(s[i])]) {
      ++i;
      continue;
    }
    int32_t index = -1;
    const size_t match_end = trie.longest(s, i, index);
    if (index < 0) {
      ++i;
      continue;
    }
    const AddedToken& t = tokens_[index];
    size_t start = i, stop = match_end;
    i = match_end;  // the automaton resumes after the match even when it is rejected below
    if (!allow_special && t.special) continue;
    const std::string_view before = s.substr(begin, start - begin), after = s.substr(stop);
    if (t.single_word) {
      const bool space_before = before.empty() || !is_word_char(last_code_point(before));
      const bool space_after = after.empty() || !is_word_char(utf8::next(after).code_point);
      if (!space_before || !space_after) continue;
    }
    if (t.lstrip) start = std::max(begin + trailing_space_start(before), start_offset);
    if (t.rstrip) stop += leading_space_length(after);
    if (start_offset < start) out.push_back({start_offset, start, -1});
    out.push_back({start, stop, t.id});
    start_offset = stop;
  }
  if (start_offset < end) out.push_back({start_offset, end, -1});
}

void AddedVocabulary::split(std::string_view text, bool allow_special, std::vector<Segment>& out) const {
  out.clear();
  if (text.empty()) return;
  if (tokens_.empty()) {
    out.push_back({0, text.size(), -1});
    return;
  }
  std::vector<Segment> first;
  split_pass(text, 0, text.size(), raw_trie_, allow_special, first);
  for (const Segment& seg : first) {
    if (seg.token >= 0) {
      out.push_back(seg);
    } else {
      split_pass(text, seg.begin, seg.end, normalized_trie_, allow_special, out);
    }
  }
}

}  // namespace dsv4
