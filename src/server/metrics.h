// SPDX-License-Identifier: MIT
// Server metrics in the Prometheus text exposition format (GET /metrics). Written from the engine thread and
// the HTTP threads, so every update takes one mutex; updates are a few per token, far below its cost.
#pragma once
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dsv4::server {

// A cumulative histogram with fixed upper bounds (seconds), rendered as _bucket{le=...}, _sum and _count.
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bucket, not cumulative; the last one is +Inf
  double sum_ = 0;
  uint64_t count_ = 0;
};

class Metrics {
 public:
  Metrics();

  void http_response(const std::string& path, int status);
  void request_rejected(const std::string& reason);  // "queue_full", "draining"
  void request_finished(const std::string& reason, double seconds);  // finish reason, arrival to last token
  void prompt_tokens(int64_t n);
  void generated_token();
  void time_to_first_token(double seconds);
  void inter_token_latency(double seconds);
  void engine_step(double seconds, int batch);

  // queue_length / running / max_batch are read from the scheduler when rendering.
  std::string render(int queue_length, int running, int max_batch) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<std::string, int>, uint64_t> http_responses_;
  std::map<std::string, uint64_t> rejected_, finished_;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0, steps_ = 0, step_sequences_ = 0;
  Histogram ttft_, itl_, request_duration_, step_;
};

}  // namespace dsv4::server
