// SPDX-License-Identifier: MIT
// Speculative decoding: cheap guesses (drafts) of the next tokens, checked by one forward over
// [last token, drafts...] instead of one forward per token (Session::generate). A draft is kept while the token the
// model draws at its position (same draw, same uniform as without speculation) equals it, so the output is the
// one plain decoding gives; rejected drafts are rolled back (SequenceRunner::rollback).
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dsv4 {

enum class DraftMethod {
  None,
  Ngram,  // prompt lookup: continue the latest earlier occurrence of the sequence's last n tokens
  Mtp,    // the checkpoint's MTP block (spec 5): one draft per step, its greedy guess of the token after next
};

struct SpeculateOptions {
  DraftMethod method = DraftMethod::None;
  int max_draft = 4;             // drafted tokens per step at most (Ngram; Mtp drafts one)
  int ngram_min = 1, ngram_max = 3;  // n-gram lengths tried, longest first
};

DraftMethod parse_draft_method(const std::string& name);  // "none", "ngram", "mtp"

// Prompt-lookup drafts: for n = ngram_max .. ngram_min, the latest position where the last n tokens of `context`
// occurred before, and up to max_tokens tokens that followed them there; empty when no n-gram recurs.
std::vector<int32_t> ngram_draft(std::span<const int32_t> context, int max_tokens, int ngram_min, int ngram_max);

}  // namespace dsv4
