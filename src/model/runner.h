// SPDX-License-Identifier: MIT
// One sequence being run on some backend. The CPU runner wraps Model + SequenceState; the CUDA backend provides
// its own runner with device-resident weights and state. Session (generation, sampling) only sees this interface.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "formats/token_draw.h"
#include "model/config.h"

namespace dsv4 {

class Model;

class SequenceRunner {
 public:
  virtual ~SequenceRunner() = default;
  virtual const ModelConfig& config() const = 0;
  // Consumes tokens at positions n_tokens().. and returns next-token logits [n, vocab] (or the last row only).
  virtual std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) = 0;
  // Consumes tokens like forward(tokens, true) and returns the next token drawn from the last row's logits by `draw`
  // (the contract of formats/token_draw.h). The default draws on the host from forward()'s logits; a backend may
  // draw on the device and bring back only the id.
  virtual int32_t forward_draw(std::span<const int32_t> tokens, const TokenDraw& draw);
  // Consumes tokens like forward(tokens, false) and returns one token per row: row i drawn by draws[i]
  // (draws.size() == tokens.size()). Speculative decoding verifies its drafts with this.
  virtual std::vector<int32_t> forward_draw_rows(std::span<const int32_t> tokens, std::span<const TokenDraw> draws);
  // Forgets the tokens at positions >= n_tokens (speculative decoding's rejected drafts): they must be among the
  // last forward call's final max_rollback() tokens. A backend that cannot roll back returns 0 and throws.
  virtual int max_rollback() const { return 0; }
  virtual void rollback(int64_t n_tokens);
  // The MTP block (spec 5), on a backend whose model has it. It trails the main model: mtp_pending() of the last
  // consumed tokens have not been paired with the token that followed them yet. mtp_draft(next_tokens) feeds it
  // those pairs, oldest first (next_tokens[i] follows the i-th pending token; next_tokens.size() <= pending),
  // and returns its greedy guess of the token after the last of next_tokens. A backend may let the MTP block skip
  // tokens it was not fed for a while (it only ever changes which drafts are proposed).
  virtual bool has_mtp() const { return false; }
  virtual int64_t mtp_pending() const { return 0; }
  virtual int32_t mtp_draft(std::span<const int32_t> next_tokens);
  virtual int64_t n_tokens() const = 0;
  virtual int max_context() const = 0;
  virtual void reset() = 0;              // start a new sequence
  virtual size_t state_bytes() const = 0;
};

std::unique_ptr<SequenceRunner> make_cpu_runner(const Model& model, int max_context);

// Makes one runner (one sequence slot) on some backend.
using RunnerFactory = std::function<std::unique_ptr<SequenceRunner>(int max_context)>;

}  // namespace dsv4
