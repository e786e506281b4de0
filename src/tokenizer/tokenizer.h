// SPDX-License-Identifier: MIT
// The DeepSeek tokenizer: a HF tokenizer.json (byte-level BPE) read and run in C++, bit-identical to
// HF `tokenizers` (checked against its Node binding on a large corpus: tests/tokenizer/).
//
// encode(text) == HF `encode(text, add_special_tokens=False)`: the tokenizer.json post-processor
// adds nothing for DeepSeek, so BOS comes from the chat format (chat_format.h), never from here.
// Input bytes that are not valid UTF-8 are first repaired to U+FFFD (maximal subparts, as Rust's
// from_utf8_lossy / JS TextDecoder do), since HF only accepts strings.
// decode(ids) == HF `decode(ids, skip_special_tokens)`: token bytes are concatenated and the result
// is repaired the same way; unknown ids are skipped, as HF does.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

class Tokenizer {
 public:
  // path_or_dir: a tokenizer.json, or a model directory holding one. tokenizer_config.json next to
  // it (optional) provides bos_token / eos_token / add_bos_token.
  static Tokenizer load(const std::string& path_or_dir);

  // Token ids of text. allow_special=false encodes the text of tokens flagged "special" (BOS, EOS,
  // ...) as ordinary text, like HF's encode_special_tokens=true. Thread-safe.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;

  // Text of ids; skip_special drops tokens flagged "special".
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  // One more than the largest id (model vocabulary and added tokens together).
  int32_t vocab_size() const;

  // Id of a token spelled exactly `token` (an added token's content, or a vocabulary spelling such
  // as "Ġthe"), if any.
  std::optional<int32_t> token_id(std::string_view token) const;
  // Spelling of an id (inverse of token_id); nullopt for ids that are not tokens.
  std::optional<std::string> id_to_token(int32_t id) const;
  bool is_special(int32_t id) const;

  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  // tokenizer_config.json "add_bos_token" (false when absent).
  bool add_bos_token() const;

  // Appends the raw bytes id stands for (possibly part of a UTF-8 character) to out. Nothing for
  // unknown ids, or for special ids when skip_special. This is what decode() concatenates.
  void append_token_bytes(int32_t id, bool skip_special, std::string& out) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Incremental detokenisation for streaming output. push() returns the text that is now complete:
// never half a UTF-8 character (an incomplete tail waits for the next token), and invalid bytes
// become U+FFFD exactly where decode() would put them, so the concatenation of all push() results
// and finish() equals decode(all ids).
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special) {}
  std::string push(int32_t id);
  // Flushes what is left (an incomplete tail becomes U+FFFD) and resets the decoder.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace dsv4
