// SPDX-License-Identifier: MIT
// HTTP transport of `dsv4 serve` (cpp-httplib): routes, Server-Sent Events, errors as OpenAI error bodies,
// overload answers (429 / 503 with Retry-After), disconnect -> cancellation, and draining shutdown.
// HTTP threads never touch the model: they parse, submit to the Scheduler and copy its events to the socket.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "server/metrics.h"
#include "server/openai_api.h"
#include "server/scheduler.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace dsv4::server {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;                  // 0: any free port (bind() returns it)
  int threads = 0;                  // HTTP worker threads; 0: enough for every slot and queue place, plus spare
  double drain_timeout_s = 30;      // on shutdown, how long running requests may take before they are cancelled
  size_t max_body_bytes = 8 << 20;  // larger request bodies get 413
};

class HttpServer {
 public:
  HttpServer(Scheduler& scheduler, ApiContext context, Metrics& metrics, HttpOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds the listening socket (throws dsv4::Error when it can't) and returns the port.
  int bind();
  // Serves until shutdown() has drained and stopped the server.
  void run();
  // Thread-safe, idempotent. New requests get 503 from now on; running ones may finish within drain_timeout_s,
  // then the rest are cancelled and the listener closes.
  void shutdown();

 private:
  void handle_generation(Endpoint endpoint, const std::string& request_body, httplib::Response& res);
  void add_routes();

  Scheduler& scheduler_;
  ApiContext context_;
  Metrics& metrics_;
  HttpOptions options_;
  std::unique_ptr<httplib::Server> http_;
  std::atomic<bool> draining_{false};
  std::once_flag shutdown_once_;

  // Generation responses still being written; shutdown waits for them before closing the server, since
  // cpp-httplib stops calling content providers once it is stopped.
  std::mutex open_mutex_;
  std::condition_variable open_cv_;
  int open_responses_ = 0;
  friend struct OpenResponse;
};

}  // namespace dsv4::server
