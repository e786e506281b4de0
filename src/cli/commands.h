// SPDX-License-Identifier: MIT
// Each `dsv4 <subcommand>` registers itself on the CLI11 app from its own file.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>

namespace dsv4::cli {

// The registered subcommand's handler runs after parsing; it returns the process exit code.
using Handler = std::function<int()>;

void add_generate_command(CLI::App& app, Handler& handler);
void add_tokenize_commands(CLI::App& app, Handler& handler);
void add_chat_command(CLI::App& app, Handler& handler);
void add_quantize_command(CLI::App& app, Handler& handler);
void add_inspect_command(CLI::App& app, Handler& handler);
void add_serve_command(CLI::App& app, Handler& handler);
void add_bench_command(CLI::App& app, Handler& handler);

}  // namespace dsv4::cli
