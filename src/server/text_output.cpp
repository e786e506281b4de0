// SPDX-License-Identifier: MIT
#include "server/text_output.h"

#include <algorithm>

namespace dsv4::server {

TextOutput::TextOutput(const Tokenizer& tokenizer, std::vector<std::string> stop)
    : decoder_(tokenizer, /*skip_special=*/true), stop_(std::move(stop)) {
  std::erase_if(stop_, [](const std::string& s) { return s.empty(); });
}

std::string TextOutput::push(int32_t id) {
  if (stopped_) return {};
  pending_ += decoder_.push(id);
  // Everything sent so far was checked: a stop string can only start inside pending_.
  size_t first_stop = std::string::npos;
  for (const std::string& s : stop_) first_stop = std::min(first_stop, pending_.find(s));
  if (first_stop != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, first_stop);
    pending_.clear();
    return out;
  }
  // Hold back the longest tail of pending_ that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : stop_)
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n)
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string TextOutput::finish() {
  if (stopped_) return {};
  std::string out = std::move(pending_) + decoder_.finish();
  pending_.clear();
  // The flushed UTF-8 tail (U+FFFD) can still complete a stop string that contains U+FFFD.
  for (const std::string& s : stop_)
    if (size_t at = out.find(s); at != std::string::npos) {
      out.resize(at);
      stopped_ = true;
    }
  return out;
}

}  // namespace dsv4::server
