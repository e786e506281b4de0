// SPDX-License-Identifier: MIT
#include "model/session.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>

#include <spdlog/spdlog.h>

#include "core/check.h"

namespace dsv4 {

int32_t SequenceRunner::forward_draw(std::span<const int32_t> tokens, const TokenDraw& draw) {
  const std::vector<float> logits = forward(tokens, true);
  return draw_token(logits, draw);
}

std::vector<int32_t> SequenceRunner::forward_draw_rows(std::span<const int32_t> tokens,
                                                      std::span<const TokenDraw> draws) {
  DSV4_CHECK(draws.size() == tokens.size(), "forward_draw_rows: {} draws for {} tokens", draws.size(),
             tokens.size());
  const std::vector<float> logits = forward(tokens, false);
  return draw_rows(logits, draws);
}

void SequenceRunner::rollback(int64_t n_tokens) {
  throw Error(fmt::format("this backend cannot roll back a sequence (asked to go back to {} tokens)", n_tokens));
}

int32_t SequenceRunner::mtp_draft(std::span<const int32_t>) {
  throw Error("this backend has no MTP block (load the model with it: --speculate mtp)");
}

namespace {

class CpuRunner final : public SequenceRunner {
 public:
  CpuRunner(const Model& model, int max_context) : model_(model), state_(model.new_sequence(max_context)) {}
  const ModelConfig& config() const override { return model_.config(); }
  std::vector<float> forward(std::span<const int32_t> tokens, bool last_only) override {
    if (!model_.has_mtp()) return model_.forward(state_, tokens, last_only);
    std::vector<float> streams;
    std::vector<float> logits = model_.forward(state_, tokens, last_only, &streams);
    mtp_rows_.insert(mtp_rows_.end(), streams.begin(), streams.end());
    // Rows the MTP block may still be fed: this call's and kMaxRollback before them. Older ones are skipped (a
    // caller that does not draft with the MTP block never feeds it).
    const int64_t limit = int64_t(tokens.size()) + kMaxRollback, extra = mtp_pending() - limit;
    if (extra > 0) {
      mtp_rows_.erase(mtp_rows_.begin(), mtp_rows_.begin() + extra * row_floats());
      state_.mtp_tokens += extra;
    }
    return logits;
  }
  int64_t n_tokens() const override { return state_.n_tokens; }
  int max_context() const override { return state_.max_context; }
  int max_rollback() const override { return kMaxRollback; }
  void rollback(int64_t n_tokens) override {
    state_.rollback(n_tokens);
    mtp_rows_.resize(size_t(state_.n_tokens - state_.mtp_tokens) * row_floats());
  }
  bool has_mtp() const override { return model_.has_mtp(); }
  int64_t mtp_pending() const override { return model_.has_mtp() ? int64_t(mtp_rows_.size() / row_floats()) : 0; }
  int32_t mtp_draft(std::span<const int32_t> next_tokens) override {
    if (!model_.has_mtp()) return SequenceRunner::mtp_draft(next_tokens);
    const int64_t n = int64_t(next_tokens.size());
    DSV4_CHECK(n >= 1 && n <= mtp_pending(), "mtp_draft: {} tokens for {} pending", n, mtp_pending());
    const std::vector<float> logits = model_.mtp_forward(state_, mtp_rows_.data(), next_tokens, true);
    mtp_rows_.erase(mtp_rows_.begin(), mtp_rows_.begin() + n * row_floats());
    TokenDraw greedy;
    greedy.vocab = model_.config().vocab_size;
    return draw_token(logits, greedy);
  }
  void reset() override {
    state_.reset();
    mtp_rows_.clear();
  }
  size_t state_bytes() const override { return state_.bytes(); }

 private:
  int64_t row_floats() const { return int64_t(model_.config().hc_mult) * model_.config().hidden_size; }

  const Model& model_;
  SequenceState state_;
  std::vector<float> mtp_rows_;  // [mtp_pending, hc·D] the main model's final streams the MTP block trails by
};

}  // namespace

std::unique_ptr<SequenceRunner> make_cpu_runner(const Model& model, int max_context) {
  return std::make_unique<CpuRunner>(model, max_context);
}

GenerateResult Session::generate(std::span<const int32_t> prompt, const GenerateOptions& options) {
  using Clock = std::chrono::steady_clock;
  DSV4_CHECK(!prompt.empty(), "the prompt is empty");
  DSV4_CHECK(options.max_new_tokens >= 0, "max_new_tokens must be >= 0, got {}", options.max_new_tokens);
  const int V = runner_.config().vocab_size;
  DSV4_CHECK(runner_.n_tokens() + int64_t(prompt.size()) <= runner_.max_context(),
             "the prompt ({} tokens, {} already in the sequence) is longer than the context of {} tokens "
             "(--max-context)", prompt.size(), runner_.n_tokens(), runner_.max_context());
  const SpeculateOptions& spec = options.speculate;
  DSV4_CHECK(spec.method == DraftMethod::None || spec.max_draft >= 1, "draft tokens must be >= 1, got {}",
             spec.max_draft);
  DSV4_CHECK(spec.method != DraftMethod::Mtp || runner_.has_mtp(),
             "speculative decoding with the MTP block: this runner has none (a checkpoint without \"mtp.0.*\", a "
             "model loaded without it, or a backend that does not run it)");
  int max_draft = 0;
  if (spec.method != DraftMethod::None) {
    const int asked = spec.method == DraftMethod::Mtp ? 1 : spec.max_draft;
    max_draft = std::min(asked, runner_.max_rollback());
    if (max_draft == 0) spdlog::warn("speculative decoding is off: this backend cannot roll back rejected drafts");
    else if (max_draft < asked) spdlog::warn("drafts limited to {} tokens by the backend", max_draft);
  }
  if (runner_.n_tokens() != int64_t(history_.size())) history_.clear();  // the runner was used without this session
  GenerateResult result;
  Sampler sampler(options.sampling);
  const auto& eos = runner_.config().eos_token_ids;

  auto keep = [&](std::span<const float> rows, int n_rows) {
    if (!options.keep_logits) return;
    result.logits.insert(result.logits.end(), rows.begin(), rows.begin() + size_t(n_rows) * V);
    result.logit_rows += n_rows;
  };
  // Without kept logits the runner draws each token itself (a backend may do it on the device and bring back only
  // the id); the sampler's generator advances the same way on both paths, so a seed gives the same tokens.
  const bool runner_draws = !options.keep_logits && options.max_new_tokens > 0;
  std::vector<float> logits;
  int32_t next = -1;
  auto t0 = Clock::now();
  if (runner_draws) {
    next = runner_.forward_draw(prompt, sampler.next_draw(V));
  } else {
    logits = runner_.forward(prompt, !options.keep_logits);
    keep(logits, int(logits.size() / V));
    if (options.max_new_tokens > 0) next = sampler.sample(std::span<const float>(logits.data() + logits.size() - V, V));
  }
  history_.insert(history_.end(), prompt.begin(), prompt.end());
  result.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  // Each step feeds `next` (chosen, not yet fed) and its drafts, then emits the drawn tokens up to the first one
  // that differs from the draft fed after it; that one becomes `next` and the drafts after it are rolled back.
  auto emit = [&](int32_t id) {  // false once generation ends
    result.output_ids.push_back(id);
    if (options.on_token) options.on_token(id);
    const bool is_eos = std::find(eos.begin(), eos.end(), id) != eos.end();
    return int(result.output_ids.size()) < options.max_new_tokens && !(options.stop_at_eos && is_eos);
  };
  // The MTP block's guess of the token after `next`: it is fed each consumed token paired with the one after it
  // (the last one with `next`), history_ holding the consumed ones.
  auto mtp_guess = [&]() -> std::optional<int32_t> {
    const int64_t pending = runner_.mtp_pending();
    if (pending == 0 || pending > int64_t(history_.size())) return std::nullopt;
    std::vector<int32_t> after(history_.end() - pending + 1, history_.end());
    after.push_back(next);
    return runner_.mtp_draft(after);
  };
  auto t1 = Clock::now();
  bool more = options.max_new_tokens > 0 && emit(next);
  std::optional<int32_t> guess;
  if (more && spec.method == DraftMethod::Mtp && max_draft > 0) guess = mtp_guess();
  std::vector<int32_t> fed, ids;
  std::vector<TokenDraw> draws;
  while (more) {
    if (runner_.n_tokens() >= runner_.max_context()) {
      spdlog::warn("context of {} tokens is full; stopping after {} new tokens", runner_.max_context(),
                   result.output_ids.size());
      break;
    }
    fed.assign(1, next);
    const int64_t room = runner_.max_context() - runner_.n_tokens() - 1;
    const int wanted = options.max_new_tokens - int(result.output_ids.size()) - 1;  // the last comes undrafted
    const int drafts_fit = int(std::min<int64_t>({max_draft, wanted, room}));
    if (spec.method == DraftMethod::Ngram && drafts_fit > 0) {
      history_.push_back(next);
      const std::vector<int32_t> drafts = ngram_draft(history_, drafts_fit, spec.ngram_min, spec.ngram_max);
      history_.pop_back();
      fed.insert(fed.end(), drafts.begin(), drafts.end());
    } else if (guess && drafts_fit > 0) {
      fed.push_back(*guess);
    }
    draws.clear();
    for (size_t i = 0; i < fed.size(); ++i) draws.push_back(sampler.next_draw(V));
    if (runner_draws) {
      ids = fed.size() == 1 ? std::vector<int32_t>{runner_.forward_draw(fed, draws[0])}
                            : runner_.forward_draw_rows(fed, draws);
    } else {
      logits = runner_.forward(fed, false);
      ids.clear();
      for (size_t i = 0; i < fed.size(); ++i) ids.push_back(sampler.draw({logits.data() + i * V, size_t(V)}, draws[i]));
    }
    size_t used = 0;  // rows whose token is emitted = fed tokens that stay
    while (used < ids.size()) {
      more = emit(ids[used]);
      ++used;
      if (!more || used == fed.size() || ids[used - 1] != fed[used]) break;
    }
    if (!runner_draws) keep(logits, int(used));
    sampler.give_back(std::span<const TokenDraw>(draws).subspan(used));
    if (used < fed.size()) runner_.rollback(runner_.n_tokens() - int64_t(fed.size() - used));
    history_.insert(history_.end(), fed.begin(), fed.begin() + used);
    next = ids[used - 1];
    result.drafted += int(fed.size()) - 1;
    result.accepted += int(used) - 1;
    ++result.decode_steps;
    if (more && spec.method == DraftMethod::Mtp && max_draft > 0) guess = mtp_guess();
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return result;
}

}  // namespace dsv4
