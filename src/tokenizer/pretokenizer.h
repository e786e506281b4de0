// SPDX-License-Identifier: MIT
// The HF pre-tokenizer of a byte-level BPE tokenizer.json: a sequence of regex Split stages.
// Each stage is applied to every piece the previous stage produced (it is NOT one big alternation),
// and "Isolated" keeps both the matches and the gaps between them as pieces.
//
// Regexes run on PCRE2 (UTF + UCP + JIT); HF runs them on Oniguruma. Two differences are rewritten
// away (rewrite_regex_for_pcre2), both measured over every code point against HF's binding:
//  * Oniguruma's `\s` is Unicode White_Space; PCRE2's also matches U+180E, so `\s` becomes the
//    explicit class [\t-\r\x{85}\p{Z}] (shared/research/ecosystem.md §1b);
//  * Oniguruma knows Unicode 16.0, Debian's PCRE2 10.42 only 14.0, so \p{L} \p{M} \p{N} \p{P} \p{S}
//    get the newer characters added (unicode_additions.h).
// DeepSeek's word regex (the third Split) also has an exact ASCII-only evaluator that answers most
// positions without calling PCRE2; it defers to PCRE2 whenever a non-ASCII character matters.
#pragma once
#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4 {

// `\s`/`\S` in an HF (Oniguruma) regex rewritten for PCRE2 so both engines agree on whitespace.
std::string rewrite_regex_for_pcre2(std::string_view pattern);

class RegexSplitter;

class PreTokenizer {
 public:
  // Reads the tokenizer.json "pre_tokenizer" object. Supported: null, Sequence, Split (Regex or
  // String pattern; behavior Isolated or Removed; invert false) and ByteLevel
  // (add_prefix_space=false; use_regex true adds the GPT-2 split). Anything else throws.
  static PreTokenizer from_json(const nlohmann::json& spec);

  PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;
  ~PreTokenizer();

  // Splits valid UTF-8 text into pieces (views into text), in order; empty pieces are dropped.
  // Thread-safe.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  std::vector<std::unique_ptr<RegexSplitter>> stages_;
};

}  // namespace dsv4
