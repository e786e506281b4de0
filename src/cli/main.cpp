// SPDX-License-Identifier: MIT
// dsv4: command-line front end. Errors from the engine arrive as dsv4::Error and end the process with
// a one-line message and exit code 1; usage errors exit with CLI11's code.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstdlib>

#include "cli/commands.h"
#include "core/check.h"

int main(int argc, char** argv) {
  // Logs go to stderr so that stdout carries only results (ids, text, JSON).
  spdlog::set_default_logger(spdlog::stderr_color_mt("dsv4"));
  if (const char* level = std::getenv("DSV4_LOG_LEVEL")) spdlog::set_level(spdlog::level::from_str(level));
  CLI::App app{"dsv4: DeepSeek-V4 inference engine", "dsv4"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "dsv4 0.1.0");
  dsv4::cli::Handler handler;
  dsv4::cli::add_generate_command(app, handler);
  dsv4::cli::add_tokenize_commands(app, handler);
  dsv4::cli::add_chat_command(app, handler);
  dsv4::cli::add_quantize_command(app, handler);
  dsv4::cli::add_inspect_command(app, handler);
  dsv4::cli::add_serve_command(app, handler);
  dsv4::cli::add_bench_command(app, handler);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return handler ? handler() : 0;
  } catch (const dsv4::Error& e) {
    std::fprintf(stderr, "dsv4: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dsv4: error: %s\n", e.what());
    return 1;
  }
}
