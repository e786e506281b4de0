// SPDX-License-Identifier: MIT
// UTF-8 helpers shared by the tokenizer. Invalid input is never rejected: it is repaired the way
// Rust's String::from_utf8_lossy (and WHATWG/Python "replace") does it, one U+FFFD per maximal
// invalid subpart, so that our output equals what HF tokenizers produces from the same bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dsv4::utf8 {

// The result of reading one sequence at the start of `s`.
struct Step {
  enum Kind { kValid, kInvalid, kIncomplete } kind;
  size_t len;          // bytes consumed: the sequence (kValid), the maximal invalid subpart (kInvalid,
                       // >= 1) or the whole truncated-but-so-far-valid tail (kIncomplete)
  char32_t code_point; // only for kValid
};

// Reads one UTF-8 sequence at the start of s (s must not be empty). kIncomplete means s ends in the
// middle of a sequence that could still become valid with more bytes.
Step next(std::string_view s);

// True when s is well-formed UTF-8.
bool is_valid(std::string_view s);

// s with every maximal invalid subpart (including a truncated tail) replaced by U+FFFD.
std::string sanitize(std::string_view s);

// Appends the UTF-8 encoding of cp.
void append(std::string& out, char32_t cp);

// Length of the longest prefix of s that does not end inside an incomplete sequence: s minus a
// trailing kIncomplete tail (at most 3 bytes). Used by streaming decoders.
size_t complete_prefix_length(std::string_view s);

}  // namespace dsv4::utf8
