// SPDX-License-Identifier: MIT
// The options every model-running subcommand shares (model, backend, state size, numerics, sampling), declared once
// so that generate, chat and serve spell and check them the same way.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <memory>
#include <string>

#include "model/batch_runner.h"
#include "model/model.h"
#include "model/runner.h"
#include "model/session.h"

namespace dsv4::cli {

struct EngineOptions {
  std::string model_dir, device = "cpu", kv_dtype = "fp8", indexer_dtype = "fp4",
              act_quant = "none";
  std::string gpus;  // --gpus 0,1: the CUDA runner's layers split over these GPUs (empty: the current one)
  std::string cpu_weights = "auto";  // --cpu-weights: fp32, packed, or auto (packed when fp32 would not fit)
  int max_context = 8192;
  int cuda_prefill_chunk = 0;  // --cuda-prefill-chunk: CudaRunnerOptions::prefill_chunk (0: its default)
  bool with_mtp = false;  // load the checkpoint's MTP block (--speculate mtp)

  static EngineOptions with_max_context(int tokens) {
    EngineOptions o;
    o.max_context = tokens;
    return o;
  }
};

// --model, --device, --gpus, --cpu-weights, --max-context, --kv-dtype, --indexer-dtype, --act-quant,
// --cuda-prefill-chunk
void add_engine_options(CLI::App* cmd, EngineOptions& options);

// Loads the model with the chosen numerics and logs its summary. On the CPU the linear layers are decoded to fp32
// (--cpu-weights fp32) or left in the checkpoint's encoding, mapped from disk and decoded a tile of rows at a time
// (packed); auto takes fp32 unless those values would need more than half the memory available (MemAvailable).
Model load_model(const EngineOptions& options);

// Makes per-sequence runners on the chosen backend; throws for a backend this build does not have.
RunnerFactory runner_factory(const Model& model, const EngineOptions& options);
// `sequences` sequences for the server's slots: on cuda one runner holding them all (one copy of the weights,
// batched decode steps), on cpu one runner each.
std::unique_ptr<BatchRunner> batch_runner(const Model& model, const EngineOptions& options, int sequences);

// --temperature, --top-p, --top-k, --seed
void add_sampling_options(CLI::App* cmd, SamplingParams& params);

// --speculate, --draft-tokens, --ngram-max
void add_speculate_options(CLI::App* cmd, SpeculateOptions& options);

}  // namespace dsv4::cli
