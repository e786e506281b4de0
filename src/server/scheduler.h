// SPDX-License-Identifier: MIT
// Continuous batching for `dsv4 serve`. One engine thread owns every SequenceRunner and is the only caller of the
// model; HTTP threads only submit requests and read their events. Every step the engine thread
//   1. drops requests that were cancelled (client gone, shutdown) and frees their slots,
//   2. admits queued requests into free slots (a slot = one sequence of the BatchRunner, sized by max_context),
//   3. runs one prefill chunk for each slot still reading its prompt, then one decode token for every other slot,
//      all of them in one BatchRunner call (one batched step on the GPU): decode_draw, which brings back only the
//      drawn ids, unless a request of the step wants logprobs (decode, logits back, drawn here),
//   4. detokenises, checks stop conditions and hands the new text to each request's handle.
// A sequence's tokens depend only on its own state, so batched output equals the output of the same request
// alone (tested in tests/server/test_scheduler.cpp).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "model/batch_runner.h"
#include "model/runner.h"
#include "model/session.h"
#include "server/metrics.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::server {

enum class FinishReason { kStop, kLength, kCancelled, kError };
const char* finish_reason_name(FinishReason reason);  // "stop", "length", "cancelled", "error"

struct TokenLogprob {
  int32_t id;
  float logprob;  // log-softmax of the model's logits (before temperature), as OpenAI reports it
};

struct GeneratedToken {
  int32_t id;
  float logprob;
  std::vector<TokenLogprob> top;  // the top_logprobs most likely tokens, most likely first
};

struct GenerationRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 16;
  SamplingParams sampling;
  std::vector<std::string> stop;  // generation ends before the first occurrence of any of these
  int top_logprobs = -1;          // -1: no logprobs; 0: the chosen token's only; k: also the k most likely
  bool ignore_eos = false;
};

// What the engine thread reports for a request since the previous event.
struct StreamEvent {
  std::string text;                    // newly complete output text (held back while it may start a stop string)
  std::vector<GeneratedToken> tokens;  // tokens chosen since the previous event
  std::optional<FinishReason> finish;  // set on the last event of the request
  std::string error;                   // why, when finish == kError
  int completion_tokens = 0;           // tokens generated so far
};

// Shared by the HTTP thread that submitted a request and the engine thread that runs it.
class RequestHandle {
 public:
  explicit RequestHandle(GenerationRequest request);
  const GenerationRequest& request() const { return request_; }

  // Moves the events that arrived into `out`; waits up to `timeout` when there are none. False on timeout.
  bool wait_events(std::vector<StreamEvent>& out, std::chrono::milliseconds timeout);
  // Asks the engine to stop this request; its slot is freed at the next step and a kCancelled event follows.
  void cancel() { cancelled_ = true; }
  bool cancelled() const { return cancelled_; }
  bool finished() const;

 private:
  friend class Scheduler;
  void push(StreamEvent event);

  const GenerationRequest request_;
  const std::chrono::steady_clock::time_point arrival_ = std::chrono::steady_clock::now();
  std::atomic<bool> cancelled_{false};
  mutable std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<StreamEvent> events_;
  bool finished_ = false;
};

struct SchedulerOptions {
  int max_batch = 8;        // slots: sequences decoded together
  int max_queue = 64;       // requests waiting for a slot; beyond this submit() refuses
  int max_context = 4096;   // tokens of state per slot (prompt + completion)
  int prefill_chunk = 256;  // prompt tokens a slot consumes per step, so long prompts don't stall the batch
  int threads = 0;          // OpenMP threads of the engine thread's forward calls; 0: the OpenMP default
};

// Makes one runner (one sequence's state) sized for max_context tokens; called max_batch times at startup.
using dsv4::RunnerFactory;
using dsv4::BatchRunner;

class Scheduler {
 public:
  enum class Admission { kAccepted, kQueueFull, kDraining };

  // One runner per slot from `make_runner`, stepped one after the other.
  Scheduler(const Tokenizer& tokenizer, const RunnerFactory& make_runner, SchedulerOptions options,
            Metrics& metrics);
  // Slots on the sequences of `runner` (at least max_batch of them, max_context each): the decoding slots of a step
  // advance in one decode() call.
  Scheduler(const Tokenizer& tokenizer, std::unique_ptr<BatchRunner> runner, SchedulerOptions options,
            Metrics& metrics);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request (prompt and max_tokens must already fit max_context: see fits_context). On refusal returns
  // null and says why in `admission`.
  std::shared_ptr<RequestHandle> submit(GenerationRequest request, Admission& admission);

  // Refuse new requests from now on (drain); running and queued ones continue.
  void stop_accepting();
  bool accepting() const { return accepting_; }
  // Cancel everything queued or running.
  void cancel_all();
  // True when nothing is queued or running.
  bool idle() const;
  // Waits until idle() or the deadline passes; true when idle.
  bool wait_idle(std::chrono::steady_clock::time_point deadline) const;
  // Cancels everything and joins the engine thread.
  void shutdown();

  const SchedulerOptions& options() const { return options_; }
  int queue_length() const;
  int running() const { return running_; }
  int vocab_limit() const { return vocab_limit_; }

 private:
  struct Slot;
  void engine_loop();
  void admit_queued();
  void prefill_slot(Slot& slot);
  void decode_slots(const std::vector<Slot*>& slots);
  void choose_token(Slot& slot, std::span<const float> logits);  // pick_token, then deliver_token
  // The token drawn from a slot's logits (and its logprobs when asked): touches only that slot's sampler.
  GeneratedToken pick_token(Slot& slot, std::span<const float> logits) const;
  // Metrics, text, stop conditions, the request's event.
  void deliver_token(Slot& slot, GeneratedToken token);
  void finish_slot(Slot& slot, FinishReason reason, std::string error = {}, StreamEvent event = {});

  const Tokenizer& tokenizer_;
  const SchedulerOptions options_;
  Metrics& metrics_;
  int vocab_limit_;                    // ids >= this are never sampled (the tokenizer knows no text for them)
  std::vector<int32_t> eos_ids_;

  mutable std::mutex mutex_;
  mutable std::condition_variable wake_;      // engine: work arrived or shutdown
  mutable std::condition_variable idle_cv_;   // drain: the engine became idle
  std::deque<std::shared_ptr<RequestHandle>> queue_;
  bool stopping_ = false;
  std::atomic<bool> accepting_{true};
  std::atomic<bool> cancel_running_{false};
  std::atomic<int> running_{0};

  std::unique_ptr<BatchRunner> runner_;       // slot i uses sequence i; touched by the engine thread only
  std::vector<std::unique_ptr<Slot>> slots_;  // touched by the engine thread only
  std::thread engine_;
};

}  // namespace dsv4::server
