// SPDX-License-Identifier: MIT
// Added tokens of a tokenizer.json (BOS/EOS, <｜User｜>, <think>, ｜DSML｜, placeholders, ...).
//
// They are cut out of the input before pre-tokenization, the way HF's AddedVocabulary does it:
//   1. tokens with normalized=false are matched on the raw text (leftmost-longest, non-overlapping,
//      like the aho-corasick automaton HF builds);
//   2. tokens with normalized=true are matched in the gaps left by step 1 (the normalizer is the
//      identity for the tokenizers we accept, so no normalisation happens in between).
// Ids follow HF's rule, not the "id" fields: a token already in the vocabulary keeps that id, any
// other gets the next free id after the model vocabulary, in declaration order.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dsv4 {

class BpeModel;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool normalized = true;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

class AddedVocabulary {
 public:
  // Reads the tokenizer.json "added_tokens" array and assigns ids against `model`.
  static AddedVocabulary from_json(const nlohmann::json& added_tokens, const BpeModel& model);

  // One stretch of the input: either plain text (token == -1) or an added token.
  struct Segment {
    size_t begin, end;
    int32_t token;
  };
  // Splits text into segments in order. allow_special=false leaves tokens flagged special as
  // plain text (HF's encode_special_tokens=true); non-special added tokens still match.
  void split(std::string_view text, bool allow_special, std::vector<Segment>& out) const;

  const std::vector<AddedToken>& tokens() const { return tokens_; }
  const AddedToken* find(std::string_view content) const;

 private:
  // A byte trie over token contents; node 0 is the root.
  struct Trie {
    struct Node {
      std::vector<std::pair<uint8_t, int32_t>> children;
      int32_t token = -1;  // index into tokens_ of the token ending here
    };
    std::vector<Node> nodes{1};
    std::array<bool, 256> first_byte{};
    void insert(std::string_view s, int32_t token);
    // Longest token starting at text[pos]; returns its end, or 0 when none (token set to -1).
    size_t longest(std::string_view text, size_t pos, int32_t& token) const;
  };
  void split_pass(std::string_view text, size_t begin, size_t end, const Trie& trie, bool allow_special,
                  std::vector<Segment>& out) const;

  std::vector<AddedToken> tokens_;
  std::unordered_map<std::string, int32_t> index_;  // content -> index into tokens_
  Trie raw_trie_, normalized_trie_;
};

}  // namespace dsv4
