// SPDX-License-Identifier: MIT
// `dsv4 quantize`: BF16/FP32 (or official FP8/FP4) checkpoint -> NVFP4 (ModelOpt layout) or the official
// DeepSeek FP8 + FP4 layout, one shard at a time. `dsv4 inspect` lives in cmd_inspect.cpp.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>

#include "cli/commands.h"
#include "quant/quantize.h"

namespace dsv4::cli {
namespace {

struct QuantizeArgs {
  std::string model_dir, out_dir, format = "nvfp4";
  bool all_linears = false;
};

// One line on stderr, redrawn with \r; only on a terminal, so logs stay clean.
void draw_progress(int64_t done, int64_t total, uint64_t bytes_out) {
  constexpr int kWidth = 40;
  const int filled = total > 0 ? int(kWidth * done / total) : kWidth;
  std::fprintf(stderr, "\r[%.*s%*s] %lld/%lld tensors, %.1f MiB written", filled,
               "########################################", kWidth - filled, "", static_cast<long long>(done),
               static_cast<long long>(total), double(bytes_out) / 1048576.0);
  if (done == total) std::fputc('\n', stderr);
  std::fflush(stderr);
}

int run_quantize(const QuantizeArgs& a) {
  QuantizeOptions o;
  o.model_dir = a.model_dir;
  o.out_dir = a.out_dir;
  o.target = parse_quant_target(a.format);
  o.all_linears = a.all_linears;
  if (isatty(STDERR_FILENO)) o.progress = draw_progress;
  const auto start = std::chrono::steady_clock::now();
  const QuantizeReport r = quantize_checkpoint(o);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const std::string& note : r.notes) std::fprintf(stderr, "note: %s\n", note.c_str());
  std::printf("%s: %lld tensors in -> %lld out (%lld quantised, %lld copied), %lld shard(s), %.2f MiB -> %.2f MiB, "
              "%.2f s\n",
              a.out_dir.c_str(), static_cast<long long>(r.tensors_in), static_cast<long long>(r.tensors_out),
              static_cast<long long>(r.quantized), static_cast<long long>(r.copied), static_cast<long long>(r.shards),
              double(r.bytes_in) / 1048576.0, double(r.bytes_out) / 1048576.0, seconds);
  return 0;
}

}  // namespace

void add_quantize_command(CLI::App& app, Handler& handler) {
  auto args = std::make_shared<QuantizeArgs>();
  CLI::App* cmd = app.add_subcommand("quantize", "Quantise a checkpoint (NVFP4 in the ModelOpt layout, or the official "
                                                 "DeepSeek FP8 + FP4 layout)");
  cmd->add_option("--model", args->model_dir, "Input model directory (config.json + safetensors)")->required();
  cmd->add_option("--out", args->out_dir, "Output directory (created)")->required();
  cmd->add_option("--format", args->format,
                  "nvfp4: routed experts to NVFP4 (W4, e4m3 scale per 16, fp32 global scale); deepseek: FP8 "
                  "128x128 linears + FP4 experts with e8m0 scales")
      ->capture_default_str()->check(CLI::IsMember({"nvfp4", "deepseek"}));
  cmd->add_flag("--all-linears", args->all_linears,
                "nvfp4: also quantise attention wq_a/wq_b/wkv/wo_a/wo_b, indexer wq_b and the shared experts");
  cmd->callback([&handler, args] { handler = [args] { return run_quantize(*args); }; });
}

}  // namespace dsv4::cli
