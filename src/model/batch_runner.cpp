// SPDX-License-Identifier: MIT
#include "model/batch_runner.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/check.h"
#include "model/sampler.h"

namespace dsv4 {

namespace {

void check_draws(std::span<const int> seqs, std::span<const TokenDraw> draws) {
  DSV4_CHECK(draws.size() == seqs.size(), "decode_draw: {} draws for {} sequences", draws.size(), seqs.size());
}

}  // namespace

std::vector<int32_t> BatchRunner::decode_draw(std::span<const int> seqs, std::span<const int32_t> tokens,
                                              std::span<const TokenDraw> draws) {
  check_draws(seqs, draws);
  return draw_rows(decode(seqs, tokens), draws);
}

namespace {

void check_decode_args(std::span<const int> seqs, std::span<const int32_t> tokens, int sequences) {
  DSV4_CHECK(!seqs.empty() && seqs.size() == tokens.size(), "decode: {} sequences for {} tokens", seqs.size(),
             tokens.size());
  std::vector<bool> seen(size_t(sequences), false);
  for (int s : seqs) {
    DSV4_CHECK(s >= 0 && s < sequences, "decode: sequence {} outside [0, {})", s, sequences);
    DSV4_CHECK(!seen[size_t(s)], "decode: sequence {} appears twice", s);
    seen[size_t(s)] = true;
  }
}

class LoopedBatchRunner final : public BatchRunner {
 public:
  LoopedBatchRunner(const RunnerFactory& make, int sequences, int max_context) {
    DSV4_CHECK(sequences >= 1, "a batch runner needs at least one sequence, got {}", sequences);
    for (int i = 0; i < sequences; ++i) {
      runners_.push_back(make(max_context));
      DSV4_CHECK(runners_.back() != nullptr, "the runner factory returned no runner for sequence {}", i);
    }
  }
  const ModelConfig& config() const override { return runners_[0]->config(); }
  int sequences() const override { return int(runners_.size()); }
  int max_context() const override { return runners_[0]->max_context(); }
  int64_t n_tokens(int seq) const override { return at(seq).n_tokens(); }
  void reset(int seq) override { at(seq).reset(); }
  void release(int seq) override { at(seq); }  // each sequence has its own runner: nothing to gain
  std::vector<float> forward(int seq, std::span<const int32_t> tokens, bool last_only) override {
    return at(seq).forward(tokens, last_only);
  }
  int32_t forward_draw(int seq, std::span<const int32_t> tokens, const TokenDraw& draw) override {
    return at(seq).forward_draw(tokens, draw);
  }
  std::vector<float> decode(std::span<const int> seqs, std::span<const int32_t> tokens) override {
    check_decode_args(seqs, tokens, sequences());
    std::vector<float> logits;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const std::vector<float> row = at(seqs[i]).forward(tokens.subspan(i, 1), true);
      logits.insert(logits.end(), row.begin(), row.end());
    }
    return logits;
  }
  std::vector<int32_t> decode_draw(std::span<const int> seqs, std::span<const int32_t> tokens,
                                   std::span<const TokenDraw> draws) override {
    check_decode_args(seqs, tokens, sequences());
    check_draws(seqs, draws);
    std::vector<int32_t> ids;
    for (size_t i = 0; i < seqs.size(); ++i) ids.push_back(at(seqs[i]).forward_draw(tokens.subspan(i, 1), draws[i]));
    return ids;
  }

 private:
  SequenceRunner& at(int seq) const {
    DSV4_CHECK(seq >= 0 && seq < int(runners_.size()), "sequence {} outside [0, {})", seq, runners_.size());
    return *runners_[size_t(seq)];
  }
  std::vector<std::unique_ptr<SequenceRunner>> runners_;
};

class PackedBatchRunner final : public BatchRunner {
 public:
  PackedBatchRunner(PackedSequences backend, int sequences) : b_(std::move(backend)), slots_(sequences) {
    DSV4_CHECK(b_.runner && b_.select && b_.decode_first && b_.copy, "packed batch runner: incomplete backend");
    DSV4_CHECK(sequences >= 1 && b_.held >= sequences + 1,
               "packed batch runner: {} slots need {} sequences held (one spare), the backend holds {}", sequences,
               sequences + 1, b_.held);
    place_.resize(size_t(sequences));
    std::iota(place_.begin(), place_.end(), 0);
    released_.assign(size_t(sequences), false);
    slot_at_.assign(size_t(b_.held), -1);
    for (int s = 0; s < sequences; ++s) slot_at_[size_t(s)] = s;
  }
  const ModelConfig& config() const override { return b_.runner->config(); }
  int sequences() const override { return slots_; }
  int max_context() const override { return b_.runner->max_context(); }
  int64_t n_tokens(int seq) const override {
    select(seq);
    return b_.runner->n_tokens();
  }
  void reset(int seq) override {
    select(seq);
    b_.runner->reset();
    released_[size_t(seq)] = false;
  }
  void release(int seq) override {
    select(seq);  // checks the index
    released_[size_t(seq)] = true;
  }
  std::vector<float> forward(int seq, std::span<const int32_t> tokens, bool last_only) override {
    select(seq);
    return b_.runner->forward(tokens, last_only);
  }
  int32_t forward_draw(int seq, std::span<const int32_t> tokens, const TokenDraw& draw) override {
    select(seq);
    return b_.runner->forward_draw(tokens, draw);
  }
  std::vector<float> decode(std::span<const int> seqs, std::span<const int32_t> tokens) override {
    check_decode_args(seqs, tokens, slots_);
    const std::vector<int32_t> by_place = place(seqs, tokens);
    std::vector<float> rows = b_.decode_first(*b_.runner, by_place);
    if (in_order(seqs)) return rows;
    const int B = int(seqs.size());
    const size_t vocab = rows.size() / size_t(B);
    std::vector<float> logits(rows.size());
    for (int i = 0; i < B; ++i)
      std::copy_n(rows.begin() + std::ptrdiff_t(size_t(place_[size_t(seqs[size_t(i)])]) * vocab), vocab,
                  logits.begin() + std::ptrdiff_t(size_t(i) * vocab));
    return logits;
  }
  std::vector<int32_t> decode_draw(std::span<const int> seqs, std::span<const int32_t> tokens,
                                   std::span<const TokenDraw> draws) override {
    if (!b_.decode_first_draw) return BatchRunner::decode_draw(seqs, tokens, draws);
    check_decode_args(seqs, tokens, slots_);
    check_draws(seqs, draws);
    const std::vector<int32_t> by_place = place(seqs, tokens);
    std::vector<TokenDraw> draws_by_place(draws.size());
    for (size_t i = 0; i < seqs.size(); ++i) draws_by_place[size_t(place_[size_t(seqs[i])])] = draws[i];
    const std::vector<int32_t> drawn = b_.decode_first_draw(*b_.runner, by_place, draws_by_place);
    std::vector<int32_t> ids(seqs.size());
    for (size_t i = 0; i < seqs.size(); ++i) ids[i] = drawn[size_t(place_[size_t(seqs[i])])];
    return ids;
  }

 private:
  // Moves the slots of a step onto backend sequences 0..B-1 (those already there stay; the others take the places
  // that no slot of this step holds) and returns the tokens in place order.
  std::vector<int32_t> place(std::span<const int> seqs, std::span<const int32_t> tokens) {
    const int B = int(seqs.size());
    std::vector<bool> held_here(size_t(B), false);
    for (int s : seqs)
      if (place_[size_t(s)] < B) held_here[size_t(place_[size_t(s)])] = true;
    int free_place = 0;
    for (int s : seqs) {
      if (place_[size_t(s)] < B) continue;
      while (held_here[size_t(free_place)]) ++free_place;
      move_to(s, free_place);
      held_here[size_t(free_place)] = true;
    }
    std::vector<int32_t> by_place(static_cast<size_t>(B));
    for (int i = 0; i < B; ++i) by_place[size_t(place_[size_t(seqs[size_t(i)])])] = tokens[size_t(i)];
    return by_place;
  }
  // Steady decoding in slot order: row i of the step is already seqs[i]'s.
  bool in_order(std::span<const int> seqs) const {
    for (size_t i = 0; i < seqs.size(); ++i)
      if (place_[size_t(seqs[i])] != int(i)) return false;
    return true;
  }
  void select(int slot) const {
    DSV4_CHECK(slot >= 0 && slot < slots_, "sequence {} outside [0, {})", slot, slots_);
    b_.select(*b_.runner, place_[size_t(slot)]);
  }
  // Slot `slot` onto backend sequence `to`, swapping with whatever slot (or free sequence) is there; a released
  // slot there is not kept, only moved.
  void move_to(int slot, int to) {
    const int from = place_[size_t(slot)];
    if (from == to) return;
    const int other = slot_at_[size_t(to)];
    if (other < 0 || released_[size_t(other)]) {
      b_.copy(*b_.runner, from, to);
    } else {
      const int spare = b_.held - 1;  // never a slot's place: slots use sequences 0..held-2 only
      b_.copy(*b_.runner, to, spare);
      b_.copy(*b_.runner, from, to);
      b_.copy(*b_.runner, spare, from);
    }
    slot_at_[size_t(to)] = slot;
    slot_at_[size_t(from)] = other;
    place_[size_t(slot)] = to;
    if (other >= 0) place_[size_t(other)] = from;
  }

  PackedSequences b_;
  const int slots_;
  std::vector<int> place_;    // slot -> backend sequence
  std::vector<int> slot_at_;  // backend sequence -> slot (-1: none)
  std::vector<bool> released_;  // slot -> its state may be overwritten
};

}  // namespace

std::unique_ptr<BatchRunner> make_looped_batch_runner(const RunnerFactory& make, int sequences, int max_context) {
  return std::make_unique<LoopedBatchRunner>(make, sequences, max_context);
}

std::unique_ptr<BatchRunner> make_packed_batch_runner(PackedSequences backend, int sequences) {
  return std::make_unique<PackedBatchRunner>(std::move(backend), sequences);
}

}  // namespace dsv4
