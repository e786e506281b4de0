// SPDX-License-Identifier: MIT
// Output text of one request, token by token: never half a UTF-8 character (StreamDecoder), and never text that
// might turn out to be the start of a stop string. Generation ends before the first stop string; the stop string
// itself is not part of the output (OpenAI semantics).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace dsv4::server {

class TextOutput {
 public:
  TextOutput(const Tokenizer& tokenizer, std::vector<std::string> stop);

  // Adds a generated token; returns the text that can be sent now. When a stop string appears, returns the text
  // before it and stopped() becomes true (later pushes are ignored).
  std::string push(int32_t id);
  // The text still held back (an incomplete UTF-8 tail becomes U+FFFD); call once at the end unless stopped().
  std::string finish();
  bool stopped() const { return stopped_; }

 private:
  StreamDecoder decoder_;
  std::vector<std::string> stop_;
  std::string pending_;  // decoded but not sent: it ends in a possible prefix of a stop string
  bool stopped_ = false;
};

}  // namespace dsv4::server
