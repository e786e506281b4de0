// SPDX-License-Identifier: MIT
#include "server/http_server.h"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <set>
#include <thread>

#include "core/check.h"

namespace dsv4::server {

namespace {

constexpr auto kPoll = std::chrono::milliseconds(50);  // how often a waiting response checks its socket

void send_json(httplib::Response& res, int status, const Json& body) {
  res.status = status;
  res.set_content(body.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n", "application/json");
}

void send_error(httplib::Response& res, const ApiError& error) { send_json(res, error.status, error_body(error)); }

void send_unavailable(httplib::Response& res, int status, const std::string& message, int retry_after_s) {
  res.set_header("Retry-After", std::to_string(retry_after_s));
  send_error(res, ApiError(status, message, {}, status == 429 ? "rate_limit_error" : "server_error",
                           status == 429 ? "queue_full" : "server_shutting_down"));
}

}  // namespace

// Counts a generation response as open while alive; it lives in the content provider, so it dies when
// cpp-httplib has finished writing (or given up on) the response.
struct OpenResponse {
  explicit OpenResponse(HttpServer& server) : server(server) {
    std::lock_guard lock(server.open_mutex_);
    ++server.open_responses_;
  }
  ~OpenResponse() {
    {
      std::lock_guard lock(server.open_mutex_);
      --server.open_responses_;
    }
    server.open_cv_.notify_all();
  }
  HttpServer& server;
};

HttpServer::HttpServer(Scheduler& scheduler, ApiContext context, Metrics& metrics, HttpOptions options)
    : scheduler_(scheduler), context_(std::move(context)), metrics_(metrics), options_(std::move(options)),
      http_(std::make_unique<httplib::Server>()) {
  // Each open stream holds a worker thread, so the pool must cover every slot and queue place; requests past
  // that are answered 429 by the scheduler instead of waiting for a thread.
  const SchedulerOptions& s = scheduler_.options();
  const int threads = options_.threads > 0 ? options_.threads : s.max_batch + s.max_queue + 16;
  http_->new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  http_->set_tcp_nodelay(true);  // SSE events are small writes: without this, Nagle + delayed ACK add ~40 ms
  http_->set_keep_alive_max_count(1000);
  http_->set_read_timeout(10, 0);
  http_->set_write_timeout(10, 0);
  http_->set_payload_max_length(options_.max_body_bytes);
  add_routes();
}

HttpServer::~HttpServer() = default;

int HttpServer::bind() {
  int port = options_.port;
  if (port == 0) {
    port = http_->bind_to_any_port(options_.host);
    DSV4_CHECK(port > 0, "cannot bind an HTTP port on {}", options_.host);
  } else {
    DSV4_CHECK(http_->bind_to_port(options_.host, port), "cannot listen on {}:{} (in use, or not an address here)",
               options_.host, port);
  }
  return port;
}

void HttpServer::run() { http_->listen_after_bind(); }

void HttpServer::shutdown() {
  std::call_once(shutdown_once_, [this] {
    draining_ = true;
    scheduler_.stop_accepting();
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(options_.drain_timeout_s));
    spdlog::info("draining: {} running, {} queued (up to {} s)", scheduler_.running(), scheduler_.queue_length(),
                 options_.drain_timeout_s);
    if (!scheduler_.wait_idle(deadline)) {
      spdlog::warn("drain timeout: cancelling {} running and {} queued requests", scheduler_.running(),
                   scheduler_.queue_length());
      scheduler_.cancel_all();
      scheduler_.wait_idle(std::chrono::steady_clock::now() + std::chrono::seconds(5));
    }
    // Let the HTTP threads write the last events and [DONE] before the server stops serving.
    std::unique_lock lock(open_mutex_);
    open_cv_.wait_until(lock, std::chrono::steady_clock::now() + std::chrono::seconds(5),
                        [&] { return open_responses_ == 0; });
    lock.unlock();
    http_->stop();
  });
}

void HttpServer::add_routes() {
  httplib::Server& http = *http_;
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining_)
      send_json(res, 503, Json{{"status", "draining"}});
    else
      send_json(res, 200, Json{{"status", "ok"}});
  });
  const auto created = std::chrono::duration_cast<std::chrono::seconds>(
                           std::chrono::system_clock::now().time_since_epoch()).count();
  auto model_object = [this, created] {
    return Json{{"id", context_.model_name}, {"object", "model"}, {"created", created}, {"owned_by", "dsv4"},
                {"max_model_len", context_.max_context}};
  };
  http.Get("/v1/models", [model_object](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, Json{{"object", "list"}, {"data", Json::array({model_object()})}});
  });
  http.Get(R"(/v1/models/(.+))", [this, model_object](const httplib::Request& req, httplib::Response& res) {
    if (req.matches[1] == context_.model_name)
      send_json(res, 200, model_object());
    else
      send_error(res, ApiError(404, fmt::format("The model '{}' does not exist", req.matches[1].str()), "model",
                               "invalid_request_error", "model_not_found"));
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(
        metrics_.render(scheduler_.queue_length(), scheduler_.running(), scheduler_.options().max_batch),
        "text/plain; version=0.0.4; charset=utf-8");
  });
  // The bodies are read here rather than by cpp-httplib, which caps bodies sent as form data (curl -d's default
  // Content-Type) at 8 KB: a JSON body is accepted whatever the Content-Type says.
  auto generation = [this](Endpoint endpoint) {
    return [this, endpoint](const httplib::Request& req, httplib::Response& res,
                            const httplib::ContentReader& read_body) {
      std::string body;
      const bool complete = read_body([&](const char* data, size_t n) {
        body.append(data, n);
        return body.size() <= options_.max_body_bytes;
      });
      if (!complete)
        return send_error(res, ApiError(413, fmt::format("The request body is larger than {} bytes",
                                                         options_.max_body_bytes)));
      handle_generation(endpoint, body, res);
    };
  };
  http.Post("/v1/completions", generation(Endpoint::kCompletions));
  http.Post("/v1/chat/completions", generation(Endpoint::kChatCompletions));

  // Anything that ends in an error status without a body (unknown path, body too large, ...) gets an
  // OpenAI-style error body too.
  http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const std::string message = res.status == 404   ? fmt::format("Unknown route: {} {}", req.method, req.path)
                                : res.status == 413 ? std::string("The request body is too large")
                                                    : fmt::format("HTTP error {}", res.status);
    send_error(res, ApiError(res.status, message, {}, res.status >= 500 ? "server_error" : "invalid_request_error"));
  });
  http.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown exception";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    spdlog::error("{} {}: {}", req.method, req.path, what);
    send_error(res, ApiError(500, "internal error: " + what, {}, "server_error"));
  });
  http.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    // Paths come from clients: label only the known ones, so that random URLs cannot grow the metrics.
    static const std::set<std::string> routes = {"/health", "/metrics", "/v1/models", "/v1/completions",
                                                 "/v1/chat/completions"};
    const bool known = routes.count(req.path) || req.path.starts_with("/v1/models/");
    metrics_.http_response(known ? (req.path.starts_with("/v1/models/") ? "/v1/models/{id}" : req.path) : "other",
                           res.status);
    spdlog::debug("{} {} -> {}", req.method, req.path, res.status);
  });
}

void HttpServer::handle_generation(Endpoint endpoint, const std::string& request_body, httplib::Response& res) {
  if (draining_) return send_unavailable(res, 503, "The server is shutting down", 5);

  // Everything a response needs, shared by the handler and the content provider that outlives it.
  struct Exchange {
    ApiRequest api;
    ResponseBuilder builder;
    std::shared_ptr<RequestHandle> handle;
    std::vector<StreamEvent> events;  // received, not yet written
    bool started = false;
    std::unique_ptr<OpenResponse> open;
  };
  std::shared_ptr<Exchange> x;
  try {
    Json body;
    try {
      body = Json::parse(request_body);
    } catch (const nlohmann::json::parse_error& e) {
      throw ApiError(400, fmt::format("The request body is not valid JSON: {}", e.what()));
    }
    ApiRequest api = parse_request(endpoint, body, context_);
    ResponseBuilder builder(api, context_);
    x = std::make_shared<Exchange>(Exchange{std::move(api), std::move(builder), {}, {}, false, nullptr});
  } catch (const ApiError& e) {
    return send_error(res, e);
  }
  x->open = std::make_unique<OpenResponse>(*this);

  Scheduler::Admission admission;
  x->handle = scheduler_.submit(x->api.generation, admission);
  if (admission == Scheduler::Admission::kQueueFull)
    return send_unavailable(res, 429, "The server is busy: every slot and queue place is taken; retry later", 1);
  if (admission == Scheduler::Admission::kDraining)
    return send_unavailable(res, 503, "The server is shutting down", 5);

  // Wait for the first token (or a failure) so that engine errors still get a proper status code.
  while (x->events.empty()) x->handle->wait_events(x->events, kPoll);
  const StreamEvent& first = x->events.front();
  if (first.finish && first.tokens.empty() &&
      (*first.finish == FinishReason::kError || *first.finish == FinishReason::kCancelled)) {
    if (*first.finish == FinishReason::kCancelled) return send_unavailable(res, 503, "The server is shutting down", 5);
    return send_error(res, ApiError(500, "generation failed: " + first.error, {}, "server_error"));
  }

  // Both kinds of response are written by a provider so that a client that goes away is noticed (the socket
  // stops being writable) and its slot freed.
  auto release = [x](bool) { x->handle->cancel(); };  // no-op when finished; frees the slot otherwise
  if (x->api.stream) {
    res.set_header("Cache-Control", "no-cache");
    res.set_header("X-Accel-Buffering", "no");
    res.set_chunked_content_provider(
        "text/event-stream",
        [x](size_t, httplib::DataSink& sink) {
          std::string out;
          if (!x->started) {
            out += x->builder.stream_start();
            x->started = true;
          }
          bool finished = false;
          for (const StreamEvent& e : x->events) {
            out += x->builder.stream_event(e);
            finished |= e.finish.has_value();
          }
          x->events.clear();
          if (finished) out += x->builder.stream_end();
          if (!out.empty() && !sink.write(out.data(), out.size())) {
            x->handle->cancel();
            return false;
          }
          if (finished) {
            sink.done();
            return true;
          }
          while (!x->handle->wait_events(x->events, kPoll))
            if (!sink.is_writable()) {
              x->handle->cancel();
              return false;
            }
          return true;
        },
        release);
  } else {
    res.set_chunked_content_provider(
        "application/json",
        [x](size_t, httplib::DataSink& sink) {
          for (;;) {
            bool finished = false;
            for (const StreamEvent& e : x->events) {
              x->builder.add(e);
              finished |= e.finish.has_value();
            }
            x->events.clear();
            if (finished) break;
            // Checked on every wake-up, not only on timeouts: a fast model delivers events faster than kPoll,
            // and a client that left must still be noticed before its completion is finished.
            if (!sink.is_writable()) {
              x->handle->cancel();
              return false;
            }
            x->handle->wait_events(x->events, kPoll);
          }
          const Json body = x->builder.error().empty()
                                ? x->builder.response()
                                : error_body(ApiError(500, x->builder.error(), {}, "server_error"));
          const std::string text = body.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
          if (!sink.write(text.data(), text.size())) return false;
          sink.done();
          return true;
        },
        release);
  }
}

}  // namespace dsv4::server
