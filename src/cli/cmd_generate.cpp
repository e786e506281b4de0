// SPDX-License-Identifier: MIT
#include "cli/commands.h"

namespace dsv4::cli {
void add_generate_command(CLI::App&, Handler&) {}
}  // namespace dsv4::cli
