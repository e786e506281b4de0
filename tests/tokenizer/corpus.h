// SPDX-License-Identifier: MIT
// A deterministic, varied text corpus for comparing the tokenizer with HF tokenizers (tests) and for
// timing it (bench/tokenizer_bench.cpp): English, Chinese, Japanese, Korean, other scripts, code,
// digit runs, whitespace runs, emoji sequences, combining marks, special-token strings (V3 and
// V4-style), random code points from all planes, invalid UTF-8 and a few very long inputs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsv4::testing {

struct CorpusEntry {
  std::string kind;  // what the entry exercises, for failure messages
  std::string bytes; // the input (may be invalid UTF-8)
};

struct CorpusOptions {
  uint64_t seed = 20261202;
  int n_random_mixed = 3000;     // strings drawn from character pools
  int n_random_codepoints = 800; // strings of arbitrary code points (all planes, unassigned too)
  int n_invalid = 300;           // strings with invalid UTF-8 inserted
  int n_dense = 2000;            // short strings densely mixing the word regex's character kinds
  size_t long_bytes = 200000;    // size of each very long input
};

std::vector<CorpusEntry> make_corpus(const CorpusOptions& options = {});

// Natural-looking text (several scripts, code, numbers) of about n bytes, for throughput runs.
std::string make_natural_text(size_t n_bytes, uint64_t seed = 7);

}  // namespace dsv4::testing
