// SPDX-License-Identifier: MIT
#include "server/metrics.h"

#include <fmt/format.h>

#include <algorithm>

namespace dsv4::server {

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(std::move(upper_bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t bucket = std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  ++counts_[bucket];
  sum_ += value;
  ++count_;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cumulative = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cumulative);
  }
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, count_, name, sum_, name, count_);
}

namespace {
// Latency buckets from 1 ms to 60 s: the tiny model decodes in well under a millisecond, a large one in tens.
std::vector<double> latency_buckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

std::string escape_label(const std::string& value) {
  std::string out;
  for (char c : value) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}
}  // namespace

Metrics::Metrics()
    : ttft_(latency_buckets()), itl_(latency_buckets()), request_duration_(latency_buckets()),
      step_(latency_buckets()) {}

void Metrics::http_response(const std::string& path, int status) {
  std::lock_guard lock(mutex_);
  ++http_responses_[{path, status}];
}

void Metrics::request_rejected(const std::string& reason) {
  std::lock_guard lock(mutex_);
  ++rejected_[reason];
}

void Metrics::request_finished(const std::string& reason, double seconds) {
  std::lock_guard lock(mutex_);
  ++finished_[reason];
  request_duration_.observe(seconds);
}

void Metrics::prompt_tokens(int64_t n) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += uint64_t(n);
}

void Metrics::generated_token() {
  std::lock_guard lock(mutex_);
  ++generated_tokens_;
}

void Metrics::time_to_first_token(double seconds) {
  std::lock_guard lock(mutex_);
  ttft_.observe(seconds);
}

void Metrics::inter_token_latency(double seconds) {
  std::lock_guard lock(mutex_);
  itl_.observe(seconds);
}

void Metrics::engine_step(double seconds, int batch) {
  std::lock_guard lock(mutex_);
  step_.observe(seconds);
  ++steps_;
  step_sequences_ += uint64_t(batch);
}

std::string Metrics::render(int queue_length, int running, int max_batch) const {
  std::lock_guard lock(mutex_);
  std::string out;
  out += "# HELP dsv4_http_responses_total HTTP responses by path and status code.\n"
         "# TYPE dsv4_http_responses_total counter\n";
  for (const auto& [key, n] : http_responses_)
    out += fmt::format("dsv4_http_responses_total{{path=\"{}\",code=\"{}\"}} {}\n", escape_label(key.first),
                       key.second, n);
  out += "# HELP dsv4_requests_finished_total Generation requests finished, by finish reason.\n"
         "# TYPE dsv4_requests_finished_total counter\n";
  for (const char* reason : {"stop", "length", "cancelled", "error"}) {
    const auto it = finished_.find(reason);
    out += fmt::format("dsv4_requests_finished_total{{reason=\"{}\"}} {}\n", reason,
                       it == finished_.end() ? 0 : it->second);
  }
  out += "# HELP dsv4_requests_rejected_total Generation requests refused before queueing (429 / 503).\n"
         "# TYPE dsv4_requests_rejected_total counter\n";
  for (const char* reason : {"queue_full", "draining"}) {
    const auto it = rejected_.find(reason);
    out += fmt::format("dsv4_requests_rejected_total{{reason=\"{}\"}} {}\n", reason,
                       it == rejected_.end() ? 0 : it->second);
  }
  out += fmt::format(
      "# HELP dsv4_prompt_tokens_total Prompt tokens of admitted requests.\n"
      "# TYPE dsv4_prompt_tokens_total counter\ndsv4_prompt_tokens_total {}\n"
      "# HELP dsv4_generation_tokens_total Tokens generated.\n"
      "# TYPE dsv4_generation_tokens_total counter\ndsv4_generation_tokens_total {}\n"
      "# HELP dsv4_engine_steps_total Engine steps (one forward per active sequence each).\n"
      "# TYPE dsv4_engine_steps_total counter\ndsv4_engine_steps_total {}\n"
      "# HELP dsv4_engine_step_sequences_total Sum over steps of the sequences in the batch.\n"
      "# TYPE dsv4_engine_step_sequences_total counter\ndsv4_engine_step_sequences_total {}\n"
      "# HELP dsv4_queue_length Requests waiting for a slot.\n"
      "# TYPE dsv4_queue_length gauge\ndsv4_queue_length {}\n"
      "# HELP dsv4_running_sequences Requests holding a slot.\n"
      "# TYPE dsv4_running_sequences gauge\ndsv4_running_sequences {}\n"
      "# HELP dsv4_max_batch Slots (--max-batch).\n"
      "# TYPE dsv4_max_batch gauge\ndsv4_max_batch {}\n",
      prompt_tokens_, generated_tokens_, steps_, step_sequences_, queue_length, running, max_batch);
  ttft_.render(out, "dsv4_time_to_first_token_seconds", "Request arrival to its first generated token.");
  itl_.render(out, "dsv4_inter_token_latency_seconds", "Time between consecutive tokens of one request.");
  request_duration_.render(out, "dsv4_request_duration_seconds", "Request arrival to its last token.");
  step_.render(out, "dsv4_engine_step_seconds", "Duration of one engine step (prefill chunks + decode).");
  return out;
}

}  // namespace dsv4::server
