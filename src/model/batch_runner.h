// SPDX-License-Identifier: MIT
// Several sequences of one model, stepped together: the server's slots. Each sequence has its own state; decode()
// advances a set of them by one token each in one call, which a backend that holds all sequences (CUDA: one runner,
// one copy of the weights, every linear layer read once per step for the whole batch) runs as one batched step.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "model/runner.h"

namespace dsv4 {

class BatchRunner {
 public:
  virtual ~BatchRunner() = default;
  virtual const ModelConfig& config() const = 0;
  virtual int sequences() const = 0;
  virtual int max_context() const = 0;
  virtual int64_t n_tokens(int seq) const = 0;
  virtual void reset(int seq) = 0;
  // Sequence `seq` holds nothing that matters until its next reset() (its request ended): a backend may overwrite it.
  virtual void release(int seq) = 0;
  // Consumes tokens on sequence `seq` (a prompt chunk) and returns next-token logits [n, vocab] or the last row.
  virtual std::vector<float> forward(int seq, std::span<const int32_t> tokens, bool last_only) = 0;
  // Like forward(seq, tokens, true), returning the next token drawn by `draw` (SequenceRunner::forward_draw).
  virtual int32_t forward_draw(int seq, std::span<const int32_t> tokens, const TokenDraw& draw) = 0;
  // One token for each of the distinct sequences seqs[i] (tokens[i]); returns their next-token logits, row i for
  // seqs[i]: [seqs.size(), vocab].
  virtual std::vector<float> decode(std::span<const int> seqs, std::span<const int32_t> tokens) = 0;
  // Like decode(), but returns the next token of each sequence drawn from its logits by draws[i]
  // (formats/token_draw.h): ids[i] for seqs[i]. The default draws on the host from decode()'s logits, the rows in
  // parallel; a backend may draw on the device and bring back only the ids.
  virtual std::vector<int32_t> decode_draw(std::span<const int> seqs, std::span<const int32_t> tokens,
                                           std::span<const TokenDraw> draws);
};

// One SequenceRunner per sequence, from `make` (any backend); decode() runs them one after the other.
std::unique_ptr<BatchRunner> make_looped_batch_runner(const RunnerFactory& make, int sequences, int max_context);

// A backend holding `held` sequences that advances sequences 0..B-1 together (the CUDA runner with
// CudaRunnerOptions::sequences). `runner`'s forward / reset / n_tokens act on the sequence chosen by select().
struct PackedSequences {
  std::unique_ptr<SequenceRunner> runner;
  int held = 0;
  std::function<void(SequenceRunner&, int)> select;
  std::function<std::vector<float>(SequenceRunner&, std::span<const int32_t>)> decode_first;  // sequences 0..B-1
  // Optional: decode_first drawing token b by draws[b] on the backend (else decode_draw draws on the host).
  std::function<std::vector<int32_t>(SequenceRunner&, std::span<const int32_t>, std::span<const TokenDraw>)>
      decode_first_draw;
  std::function<void(SequenceRunner&, int from, int to)> copy;  // state and length of `from` onto `to`
};

// `sequences` slots on a PackedSequences backend with held >= sequences + 1. Before a decode() of B slots, those of
// them not on sequences 0..B-1 move onto the places there that the others leave free, swapping states through the
// spare sequence (three state copies, one when the slot moved out was released); a set of slots that keeps decoding
// keeps its places, so steady decoding moves nothing, and one slot leaving or joining moves at most one.
std::unique_ptr<BatchRunner> make_packed_batch_runner(PackedSequences backend, int sequences);

}  // namespace dsv4
