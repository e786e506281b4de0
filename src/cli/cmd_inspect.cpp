// SPDX-License-Identifier: MIT
// `dsv4 inspect`: config summary and a table of tensor groups x storage formats.
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "quant/inspect.h"

namespace dsv4::cli {

void add_inspect_command(CLI::App& app, Handler& handler) {
  auto model_dir = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("inspect", "Print a checkpoint's config, formats per tensor group, parameter "
                                                "count, bytes on disk and bytes read per decoded token");
  cmd->add_option("--model", *model_dir, "Model directory (config.json + safetensors)")->required();
  cmd->callback([&handler, model_dir] {
    handler = [model_dir] {
      std::fputs(format_report(inspect_checkpoint(*model_dir)).c_str(), stdout);
      return 0;
    };
  });
}

}  // namespace dsv4::cli
