// SPDX-License-Identifier: MIT
#include "model/speculate.h"

#include <algorithm>

#include "core/check.h"

namespace dsv4 {

DraftMethod parse_draft_method(const std::string& name) {
  if (name == "none") return DraftMethod::None;
  if (name == "ngram") return DraftMethod::Ngram;
  if (name == "mtp") return DraftMethod::Mtp;
  throw Error(fmt::format("unknown draft method \"{}\" (expected none, ngram or mtp)", name));
}

std::vector<int32_t> ngram_draft(std::span<const int32_t> context, int max_tokens, int ngram_min, int ngram_max) {
  const int64_t len = int64_t(context.size());
  if (max_tokens <= 0) return {};
  for (int n = std::min<int64_t>(ngram_max, len - 1); n >= std::max(ngram_min, 1); --n) {
    const auto suffix = context.subspan(len - n);
    // Latest occurrence first: recent text predicts the continuation best. An occurrence may overlap the suffix
    // (a repeating run), never be it.
    for (int64_t start = len - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), context.begin() + start)) continue;
      const int64_t from = start + n, count = std::min<int64_t>(max_tokens, len - from);
      return {context.begin() + from, context.begin() + from + count};
    }
  }
  return {};
}

}  // namespace dsv4
