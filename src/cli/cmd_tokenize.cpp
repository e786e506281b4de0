// SPDX-License-Identifier: MIT
// `dsv4 tokenize` / `dsv4 detokenize` (issue 3): not registered until the tokenizer lands.
#include "cli/commands.h"

namespace dsv4::cli {
void add_tokenize_commands(CLI::App&, Handler&) {}
}  // namespace dsv4::cli
