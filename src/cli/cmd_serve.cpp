// SPDX-License-Identifier: MIT
// `dsv4 serve`: the OpenAI-compatible HTTP server (src/server/). SIGTERM / SIGINT drain: new requests get 503,
// running ones finish (up to --drain-timeout), then the process exits 0. A second signal cancels what is left.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <thread>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "core/check.h"
#include "model/model.h"
#include "model/runner.h"
#include "server/http_server.h"
#include "server/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {
namespace {

struct ServeArgs {
  EngineOptions engine = EngineOptions::with_max_context(4096);
  std::string host = "127.0.0.1", served_model_name;
  int port = 8000, max_batch = 8, max_queue = 64, prefill_chunk = 256, http_threads = 0, threads = 0;
  double drain_timeout = 30;
};

// SIGTERM / SIGINT may land on any thread (OpenBLAS starts its own at load time), so the handler only writes
// the signal number into a pipe; a normal thread reads it and drives the shutdown.
int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
}

void install_signal_handlers() {
  DSV4_CHECK(pipe(g_signal_pipe) == 0, "cannot create the signal pipe");
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  std::signal(SIGPIPE, SIG_IGN);  // a client that went away must not end the process
}

int run_serve(const ServeArgs& a) {
  install_signal_handlers();

  const EngineOptions& e = a.engine;
  const Tokenizer tokenizer = Tokenizer::load(e.model_dir);
  const Model model = load_model(e);
  if (tokenizer.vocab_size() > model.config().vocab_size)
    spdlog::warn("the tokenizer knows {} ids but the model only {}; ids past the model are never produced",
                 tokenizer.vocab_size(), model.config().vocab_size);

  server::Metrics metrics;
  server::SchedulerOptions scheduling{a.max_batch, a.max_queue, e.max_context, a.prefill_chunk, a.threads};
  server::Scheduler scheduler(tokenizer, batch_runner(model, e, a.max_batch), scheduling,
                              metrics);
  std::string name = a.served_model_name;
  if (name.empty()) {
    std::filesystem::path dir = std::filesystem::absolute(e.model_dir).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();  // "models/tiny/"
    name = dir.filename().string();
  }
  server::ApiContext context{tokenizer, name, e.max_context, model.config().vocab_size};
  server::HttpOptions http_options{a.host, a.port, a.http_threads, a.drain_timeout};
  server::HttpServer server(scheduler, context, metrics, http_options);
  const int port = server.bind();

  std::thread signal_thread([&] {
    std::thread drain;
    for (int received = 0;;) {
      unsigned char sig = 0;
      if (read(g_signal_pipe[0], &sig, 1) != 1 || sig == 0) break;  // 0: the server stopped on its own
      if (++received == 1) {
        spdlog::info("signal {}: draining", int(sig));
        drain = std::thread([&] { server.shutdown(); });
      } else {
        spdlog::warn("signal {} again: cancelling every request", int(sig));
        scheduler.cancel_all();
      }
    }
    if (drain.joinable()) drain.join();
  });

  spdlog::info("{} slots x {} tokens of context, queue {}", a.max_batch, e.max_context, a.max_queue);
  std::printf("dsv4 serve: model '%s' listening on http://%s:%d\n", name.c_str(), a.host.c_str(), port);
  std::fflush(stdout);
  server.run();

  const unsigned char stop = 0;
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &stop, 1);  // ends the signal thread's loop
  signal_thread.join();
  scheduler.shutdown();
  spdlog::info("server stopped");
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app, Handler& handler) {
  auto args = std::make_shared<ServeArgs>();
  CLI::App* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server with continuous batching");
  add_engine_options(cmd, args->engine);
  cmd->add_option("--host", args->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", args->port, "Port to listen on; 0 picks a free one (printed on stdout)")
      ->capture_default_str()->check(CLI::Range(0, 65535));
  cmd->add_option("--max-batch", args->max_batch, "Sequences decoded together (slots; at most 63 on --device cuda)")
      ->capture_default_str()->check(CLI::Range(1, 4096));
  cmd->add_option("--max-queue", args->max_queue, "Requests that may wait for a slot; more get 429")
      ->capture_default_str()->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--prefill-chunk", args->prefill_chunk, "Prompt tokens one sequence consumes per step")
      ->capture_default_str()->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--threads", args->threads, "CPU threads of the engine's forward pass (0: OpenMP's default)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--served-model-name", args->served_model_name,
                  "Model id in the API (default: the model directory's name)");
  cmd->add_option("--drain-timeout", args->drain_timeout, "Seconds running requests may take after SIGTERM")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--http-threads", args->http_threads, "HTTP worker threads (0: max-batch + max-queue + 16)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->callback([&handler, args] { handler = [args] { return run_serve(*args); }; });
}

}  // namespace dsv4::cli
