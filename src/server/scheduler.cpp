// SPDX-License-Identifier: MIT
#include "server/scheduler.h"

#include <omp.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/check.h"
#include "core/parallel.h"
#include "server/text_output.h"

namespace dsv4::server {

using Clock = std::chrono::steady_clock;

namespace {
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kCancelled: return "cancelled";
    case FinishReason::kError: return "error";
  }
  return "error";
}

RequestHandle::RequestHandle(GenerationRequest request) : request_(std::move(request)) {}

bool RequestHandle::wait_events(std::vector<StreamEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  if (!ready_.wait_for(lock, timeout, [&] { return !events_.empty(); })) return false;
  for (StreamEvent& e : events_) out.push_back(std::move(e));
  events_.clear();
  return true;
}

bool RequestHandle::finished() const {
  std::lock_guard lock(mutex_);
  return finished_;
}

void RequestHandle::push(StreamEvent event) {
  {
    std::lock_guard lock(mutex_);
    if (event.finish) finished_ = true;
    events_.push_back(std::move(event));
  }
  ready_.notify_all();
}

// One batch position: a sequence's state plus the request using it (none when free).
struct Scheduler::Slot {
  int seq = 0;  // its sequence of the BatchRunner
  std::shared_ptr<RequestHandle> request;
  size_t prompt_done = 0;  // prompt tokens already consumed by the model
  int32_t last_token = -1; // chosen but not yet fed back
  int generated = 0;
  std::optional<Sampler> sampler;
  std::optional<TextOutput> text;
  Clock::time_point last_token_time;
};

namespace {
const SchedulerOptions& checked(const SchedulerOptions& options) {
  DSV4_CHECK(options.max_batch >= 1, "--max-batch must be >= 1, got {}", options.max_batch);
  DSV4_CHECK(options.max_queue >= 0, "--max-queue must be >= 0, got {}", options.max_queue);
  DSV4_CHECK(options.max_context >= 2, "--max-context must be >= 2, got {}", options.max_context);
  DSV4_CHECK(options.prefill_chunk >= 1, "--prefill-chunk must be >= 1, got {}", options.prefill_chunk);
  return options;
}
}  // namespace

Scheduler::Scheduler(const Tokenizer& tokenizer, const RunnerFactory& make_runner, SchedulerOptions options,
                     Metrics& metrics)
    : Scheduler(tokenizer, make_looped_batch_runner(make_runner, checked(options).max_batch, options.max_context),
                options, metrics) {}

Scheduler::Scheduler(const Tokenizer& tokenizer, std::unique_ptr<BatchRunner> runner, SchedulerOptions options,
                     Metrics& metrics)
    : tokenizer_(tokenizer), options_(checked(options)), metrics_(metrics), runner_(std::move(runner)) {
  DSV4_CHECK(runner_ && runner_->sequences() >= options.max_batch,
             "the batch runner holds {} sequences for {} slots", runner_ ? runner_->sequences() : 0,
             options.max_batch);
  DSV4_CHECK(runner_->max_context() >= options.max_context, "the batch runner's context {} is below --max-context {}",
             runner_->max_context(), options.max_context);
  for (int i = 0; i < options.max_batch; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->seq = i;
    slots_.push_back(std::move(slot));
  }
  const ModelConfig& config = runner_->config();
  vocab_limit_ = std::min<int>(config.vocab_size, tokenizer.vocab_size());
  eos_ids_ = config.eos_token_ids;
  if (auto eos = tokenizer.eos_id(); eos && std::find(eos_ids_.begin(), eos_ids_.end(), *eos) == eos_ids_.end())
    eos_ids_.push_back(*eos);
  engine_ = std::thread([this] { engine_loop(); });
}

Scheduler::~Scheduler() { shutdown(); }

std::shared_ptr<RequestHandle> Scheduler::submit(GenerationRequest request, Admission& admission) {
  DSV4_CHECK(!request.prompt.empty(), "the request has an empty prompt");
  DSV4_CHECK(request.max_tokens >= 1, "max_tokens must be >= 1, got {}", request.max_tokens);
  DSV4_CHECK(int64_t(request.prompt.size()) < options_.max_context,
             "the prompt ({} tokens) does not fit the context of {} tokens", request.prompt.size(),
             options_.max_context);
  for (int32_t id : request.prompt)
    DSV4_CHECK(id >= 0 && id < runner_->config().vocab_size, "prompt token id {} is outside the vocabulary",
               id);
  auto handle = std::make_shared<RequestHandle>(std::move(request));
  {
    std::lock_guard lock(mutex_);
    if (!accepting_ || stopping_) {
      admission = Admission::kDraining;
    } else if (int(queue_.size()) >= options_.max_queue + (options_.max_batch - running_)) {
      admission = Admission::kQueueFull;  // every slot busy and the waiting line full
    } else {
      admission = Admission::kAccepted;
      queue_.push_back(handle);
    }
  }
  if (admission != Admission::kAccepted) {
    metrics_.request_rejected(admission == Admission::kQueueFull ? "queue_full" : "draining");
    return nullptr;
  }
  wake_.notify_one();
  return handle;
}

void Scheduler::stop_accepting() { accepting_ = false; }

void Scheduler::cancel_all() {
  std::lock_guard lock(mutex_);
  for (auto& r : queue_) r->cancel();
  cancel_running_ = true;  // the slots belong to the engine thread: it cancels the running ones itself
  wake_.notify_one();
}

bool Scheduler::idle() const {
  std::lock_guard lock(mutex_);
  return queue_.empty() && running_ == 0;
}

bool Scheduler::wait_idle(Clock::time_point deadline) const {
  std::unique_lock lock(mutex_);
  return idle_cv_.wait_until(lock, deadline, [&] { return queue_.empty() && running_ == 0; });
}

void Scheduler::shutdown() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_ && !engine_.joinable()) return;
    stopping_ = true;
    accepting_ = false;
  }
  cancel_all();
  if (engine_.joinable()) engine_.join();
}

int Scheduler::queue_length() const {
  std::lock_guard lock(mutex_);
  return int(queue_.size());
}

void Scheduler::engine_loop() {
  if (options_.threads > 0) omp_set_num_threads(options_.threads);  // applies to parallel regions this thread opens
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stopping_ || cancel_running_ || !queue_.empty() || running_ > 0; });
      if (stopping_ && queue_.empty() && running_ == 0) return;
    }
    const bool cancel_everything = cancel_running_.exchange(false);
    admit_queued();
    const auto step_start = Clock::now();
    int batch = 0;
    std::vector<Slot*> decoding;  // slots whose prompt was consumed before this step
    for (auto& slot : slots_) {
      if (!slot->request) continue;
      if (cancel_everything) slot->request->cancel();
      ++batch;
      if (slot->request->cancelled()) {
        finish_slot(*slot, FinishReason::kCancelled);
      } else if (slot->prompt_done < slot->request->request().prompt.size()) {
        prefill_slot(*slot);
      } else {
        decoding.push_back(slot.get());
      }
    }
    if (!decoding.empty()) decode_slots(decoding);
    if (batch > 0) metrics_.engine_step(seconds_since(step_start), batch);
    std::lock_guard lock(mutex_);
    if (queue_.empty() && running_ == 0) idle_cv_.notify_all();
  }
}

void Scheduler::admit_queued() {
  std::lock_guard lock(mutex_);
  // Cancelled requests leave the line without ever taking a slot.
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (!(*it)->cancelled()) {
      ++it;
      continue;
    }
    StreamEvent event;
    event.finish = FinishReason::kCancelled;
    metrics_.request_finished("cancelled", seconds_since((*it)->arrival_));
    (*it)->push(std::move(event));
    it = queue_.erase(it);
  }
  for (auto& slot : slots_) {
    if (queue_.empty()) break;
    if (slot->request) continue;
    slot->request = std::move(queue_.front());
    queue_.pop_front();
    const GenerationRequest& r = slot->request->request();
    runner_->reset(slot->seq);
    slot->prompt_done = 0;
    slot->last_token = -1;
    slot->generated = 0;
    slot->sampler.emplace(r.sampling);
    slot->text.emplace(tokenizer_, r.stop);
    ++running_;
    metrics_.prompt_tokens(int64_t(r.prompt.size()));
  }
}

void Scheduler::prefill_slot(Slot& slot) {
  const GenerationRequest& r = slot.request->request();
  const std::vector<int32_t>& prompt = r.prompt;
  try {
    const size_t n = std::min(size_t(options_.prefill_chunk), prompt.size() - slot.prompt_done);
    const std::span<const int32_t> chunk(prompt.data() + slot.prompt_done, n);
    const bool last = slot.prompt_done + n == prompt.size();
    if (last && r.top_logprobs < 0) {  // only the first token is needed: the runner draws it
      const int32_t id = runner_->forward_draw(slot.seq, chunk, slot.sampler->next_draw(vocab_limit_));
      slot.prompt_done += n;
      deliver_token(slot, GeneratedToken{id, 0.0f, {}});
      return;
    }
    const std::vector<float> logits = runner_->forward(slot.seq, chunk, true);
    slot.prompt_done += n;
    if (last) choose_token(slot, logits);
  } catch (const std::exception& e) {
    spdlog::error("request failed in the engine: {}", e.what());
    finish_slot(slot, FinishReason::kError, e.what());
  }
}

void Scheduler::decode_slots(const std::vector<Slot*>& slots) {
  std::vector<int> seqs;
  std::vector<int32_t> tokens;
  for (const Slot* slot : slots) {
    seqs.push_back(slot->seq);
    tokens.push_back(slot->last_token);
  }
  auto fail_all = [&](const std::exception& e) {
    spdlog::error("a decode step of {} requests failed in the engine: {}", slots.size(), e.what());
    for (Slot* slot : slots) finish_slot(*slot, FinishReason::kError, e.what());
  };
  // Without log-probabilities to report, only the drawn ids are needed: the runner draws them (on the device when
  // the backend can), each slot's draw from its own sampler, like pick_token would.
  const bool logits_wanted = std::any_of(slots.begin(), slots.end(),
                                         [](const Slot* s) { return s->request->request().top_logprobs >= 0; });
  if (!logits_wanted) {
    std::vector<TokenDraw> draws;
    for (Slot* slot : slots) draws.push_back(slot->sampler->next_draw(vocab_limit_));
    std::vector<int32_t> ids;
    try {
      ids = runner_->decode_draw(seqs, tokens, draws);
    } catch (const std::exception& e) {
      fail_all(e);
      return;
    }
    for (size_t i = 0; i < slots.size(); ++i) deliver_token(*slots[i], GeneratedToken{ids[i], 0.0f, {}});
    return;
  }
  std::vector<float> logits;
  try {
    logits = runner_->decode(seqs, tokens);
  } catch (const std::exception& e) {
    fail_all(e);
    return;
  }
  // A draw over a 129K vocabulary takes 0.2-2 ms (docs/perf.md): the slots draw in parallel (each from its own
  // sampler, so the tokens do not depend on the threads), then hand their tokens over in slot order.
  const size_t vocab = logits.size() / slots.size();
  std::vector<GeneratedToken> picked(slots.size());
  const std::vector<std::string> failed = parallel_indices(int(slots.size()), [&](int i) {
    picked[size_t(i)] = pick_token(*slots[size_t(i)], std::span<const float>(logits).subspan(size_t(i) * vocab, vocab));
  });
  for (size_t i = 0; i < slots.size(); ++i) {
    if (failed[i].empty()) {
      deliver_token(*slots[i], std::move(picked[i]));
    } else {
      spdlog::error("request failed choosing its token: {}", failed[i]);
      finish_slot(*slots[i], FinishReason::kError, failed[i]);
    }
  }
}

void Scheduler::choose_token(Slot& slot, std::span<const float> logits_row) {
  deliver_token(slot, pick_token(slot, logits_row));
}

GeneratedToken Scheduler::pick_token(Slot& slot, std::span<const float> logits_row) const {
  const GenerationRequest& r = slot.request->request();
  // Ids the tokenizer has no text for (the model's vocabulary may be padded past it) are never chosen.
  const std::span<const float> logits = logits_row.first(size_t(vocab_limit_));
  GeneratedToken token{slot.sampler->sample(logits), 0.0f, {}};
  if (r.top_logprobs >= 0) {
    const float max_logit = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (float l : logits) sum += std::exp(double(l) - max_logit);
    const float log_z = max_logit + float(std::log(sum));
    token.logprob = logits[size_t(token.id)] - log_z;
    const int k = std::min(r.top_logprobs, vocab_limit_);
    std::vector<int32_t> order(logits.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
      return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
    });
    for (int i = 0; i < k; ++i) token.top.push_back({order[size_t(i)], logits[size_t(order[size_t(i)])] - log_z});
  }
  return token;
}

void Scheduler::deliver_token(Slot& slot, GeneratedToken token) {
  const GenerationRequest& r = slot.request->request();
  const auto now = Clock::now();
  if (slot.generated == 0)
    metrics_.time_to_first_token(std::chrono::duration<double>(now - slot.request->arrival_).count());
  else
    metrics_.inter_token_latency(std::chrono::duration<double>(now - slot.last_token_time).count());
  metrics_.generated_token();
  slot.last_token_time = now;
  slot.last_token = token.id;
  ++slot.generated;

  StreamEvent event;
  event.tokens.push_back(std::move(token));
  std::optional<FinishReason> finish;
  const bool is_eos = std::find(eos_ids_.begin(), eos_ids_.end(), slot.last_token) != eos_ids_.end();
  if (is_eos && !r.ignore_eos) {
    finish = FinishReason::kStop;  // the end-of-sequence token has no text
  } else {
    event.text = slot.text->push(slot.last_token);
    if (slot.text->stopped())
      finish = FinishReason::kStop;
    else if (slot.generated >= r.max_tokens || runner_->n_tokens(slot.seq) >= runner_->max_context())
      finish = FinishReason::kLength;  // asked-for length reached, or no room to feed the token back
  }
  if (finish) {
    event.text += slot.text->finish();
    return finish_slot(slot, *finish, {}, std::move(event));
  }
  event.completion_tokens = slot.generated;
  slot.request->push(std::move(event));
}

void Scheduler::finish_slot(Slot& slot, FinishReason reason, std::string error, StreamEvent event) {
  event.finish = reason;
  event.error = std::move(error);
  event.completion_tokens = slot.generated;
  metrics_.request_finished(finish_reason_name(reason), seconds_since(slot.request->arrival_));
  slot.request->push(std::move(event));
  slot.request.reset();
  runner_->release(slot.seq);
  slot.sampler.reset();
  slot.text.reset();
  std::lock_guard lock(mutex_);
  --running_;
}

}  // namespace dsv4::server
