// SPDX-License-Identifier: MIT
#include "cli/engine_options.h"

#include <spdlog/spdlog.h>

#include <fstream>
#include <map>
#include <optional>
#include <string>

#include "core/check.h"
#include "core/dtype.h"
#include "io/safetensors.h"
#ifdef DSV4_HAVE_CUDA
#include "cuda/runner.h"
#endif

namespace dsv4::cli {

void add_engine_options(CLI::App* cmd, EngineOptions& o) {
  cmd->add_option("--model", o.model_dir, "Model directory (config.json, safetensors, tokenizer.json)")->required();
  cmd->add_option("--device", o.device, "Backend: cpu, or cuda in builds with DSV4_CUDA")->capture_default_str();
  cmd->add_option("--gpus", o.gpus,
                  "With --device cuda: the GPUs to split the layers over, in order (e.g. 0,1; a model larger than one "
                  "GPU). Default: the current GPU alone");
  cmd->add_option("--cpu-weights", o.cpu_weights,
                  "With --device cpu: the linear layers as fp32 values, or packed in the checkpoint's encoding "
                  "(FP8 / FP4 / NVFP4 / BF16; mapped from disk, decoded a tile at a time: 4-8x less memory), or auto "
                  "(packed when fp32 would take more than half the available memory)")
      ->capture_default_str()->check(CLI::IsMember({"auto", "fp32", "packed"}));
  cmd->add_option("--max-context", o.max_context, "Tokens of state preallocated per sequence")
      ->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--cuda-prefill-chunk", o.cuda_prefill_chunk,
                  "With --device cuda: prompt tokens per prefill chunk, a multiple of 64 up to 4096 (default 4096, "
                  "lowered to fit the GPU; each chunk reads the weights of every expert it touches once, larger "
                  "chunks need more GPU workspace)")
      ->check([](const std::string& v) {
        int n = 0;
        const bool ok = CLI::detail::lexical_cast(v, n) && n >= 64 && n <= 4096 && n % 64 == 0;
        return ok ? std::string() : "must be a multiple of 64 in [64, 4096], got " + v;
      });
  cmd->add_option("--kv-dtype", o.kv_dtype, "KV cache storage: fp8 (official rounding), bf16, f32")
      ->capture_default_str()->check(CLI::IsMember({"fp8", "bf16", "f32"}));
  cmd->add_option("--indexer-dtype", o.indexer_dtype, "Indexer q/k storage: fp4 (official), bf16, f32")
      ->capture_default_str()->check(CLI::IsMember({"fp4", "bf16", "f32"}));
  cmd->add_option("--act-quant", o.act_quant,
                  "Inputs of the FP8/FP4 linears: none, or fp8 (the official per-128-block quantisation; on CUDA "
                  "x is quantised before each such linear, or inside the W4A8 kernel when DSV4_GEMV_TILES=0)")
      ->capture_default_str()->check(CLI::IsMember({"none", "fp8"}));
}

namespace {

// MemAvailable of /proc/meminfo, when there is one.
std::optional<double> available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024.0;
  return std::nullopt;
}

WeightLoad cpu_weight_load(const EngineOptions& o) {
  if (o.cpu_weights == "fp32") return WeightLoad::DecodeAll;
  if (o.cpu_weights == "packed") return WeightLoad::KeepLinearsPacked;
  // auto: the checkpoint's values as fp32 (a packed fp4 byte holds two) against the memory available. The config
  // first: a directory that is not a model is reported as Model::load reports it.
  (void)ModelConfig::from_model_dir(o.model_dir);
  const Checkpoint checkpoint = Checkpoint::open(o.model_dir);
  double fp32_bytes = 0, stored_bytes = 0;
  for (const auto& [name, t] : checkpoint.tensors()) {
    const bool fp4_pairs = t->dtype == DType::U8 || t->dtype == DType::I8;
    fp32_bytes += double(t->numel()) * (fp4_pairs ? 2 : 1) * 4;
    stored_bytes += double(t->nbytes);
  }
  const std::optional<double> available = available_memory_bytes();
  if (!available) {
    spdlog::info("--cpu-weights auto: no /proc/meminfo; the weights are decoded to fp32 ({:.2f} GB)", fp32_bytes / 1e9);
    return WeightLoad::DecodeAll;
  }
  if (fp32_bytes <= 0.5 * *available) return WeightLoad::DecodeAll;
  spdlog::info("--cpu-weights auto: the weights as fp32 would take {:.1f} GB of the {:.1f} GB available; the linear "
               "layers stay in the checkpoint's encoding ({:.1f} GB stored, mapped from disk) and are decoded a tile of "
               "rows at a time (--cpu-weights fp32 forces the decode)",
               fp32_bytes / 1e9, *available / 1e9, stored_bytes / 1e9);
  return WeightLoad::KeepLinearsPacked;
}

}  // namespace

Model load_model(const EngineOptions& o) {
  // The CUDA runner uploads the checkpoint's encodings as they are; the CPU decodes them to fp32 or keeps them too.
  const WeightLoad load = o.device == "cuda" ? WeightLoad::KeepLinearsPacked : cpu_weight_load(o);
  Model model =
      Model::load(o.model_dir,
                  {parse_kv_storage(o.kv_dtype), parse_indexer_storage(o.indexer_dtype), parse_act_quant(o.act_quant)},
                  load, o.with_mtp);
  spdlog::info("model {}: {}", o.model_dir, model.config().summary());
  return model;
}

#ifdef DSV4_HAVE_CUDA
namespace {
CudaRunnerOptions cuda_options(const EngineOptions& o) {
  CudaRunnerOptions options;
  if (!o.gpus.empty()) options.devices = parse_cuda_devices(o.gpus);
  if (o.cuda_prefill_chunk) options.prefill_chunk = o.cuda_prefill_chunk;
  return options;
}
}  // namespace
#endif

RunnerFactory runner_factory(const Model& model, const EngineOptions& o) {
  DSV4_CHECK(o.gpus.empty() || o.device == "cuda", "--gpus {} needs --device cuda", o.gpus);
  DSV4_CHECK(o.cuda_prefill_chunk == 0 || o.device == "cuda", "--cuda-prefill-chunk {} needs --device cuda",
             o.cuda_prefill_chunk);
  if (o.device == "cpu") return [&model](int max_context) { return make_cpu_runner(model, max_context); };
#ifdef DSV4_HAVE_CUDA
  if (o.device == "cuda") {
    const CudaRunnerOptions options = cuda_options(o);
    return [&model, options](int max_context) { return make_cuda_runner(model, max_context, options); };
  }
  DSV4_FAIL("--device {}: expected cpu or cuda", o.device);
#else
  DSV4_FAIL("--device {}: this build has only the cpu backend (configure with -DDSV4_CUDA=ON for cuda)", o.device);
#endif
}

std::unique_ptr<BatchRunner> batch_runner(const Model& model, const EngineOptions& o, int sequences) {
#ifdef DSV4_HAVE_CUDA
  if (o.device == "cuda") {  // one runner: one copy of the weights, plus a spare sequence for moving states
    DSV4_CHECK(sequences >= 1 && sequences + 1 <= kCudaMaxChunk,
               "--device cuda holds at most {} slots (--max-batch), got {}", kCudaMaxChunk - 1, sequences);
    CudaRunnerOptions options = cuda_options(o);
    options.sequences = sequences + 1;
    PackedSequences backend;
    backend.runner = make_cuda_runner(model, o.max_context, options);
    backend.held = sequences + 1;
    backend.select = [](SequenceRunner& r, int seq) { cuda_runner_select_sequence(r, seq); };
    backend.decode_first = [](SequenceRunner& r, std::span<const int32_t> tokens) {
      return cuda_runner_decode_batch(r, tokens);
    };
    backend.copy = [](SequenceRunner& r, int from, int to) { cuda_runner_copy_sequence(r, from, to); };
    backend.decode_first_draw = [](SequenceRunner& r, std::span<const int32_t> tokens,
                                   std::span<const TokenDraw> draws) {
      return cuda_runner_decode_batch_draw(r, tokens, draws);  // on the device, or logits back and drawn on the host
    };
    return make_packed_batch_runner(std::move(backend), sequences);
  }
#endif
  return make_looped_batch_runner(runner_factory(model, o), sequences, o.max_context);
}

void add_sampling_options(CLI::App* cmd, SamplingParams& p) {
  cmd->add_option("--temperature", p.temperature, "Sampling temperature; 0 = greedy")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", p.top_p, "Nucleus sampling threshold in (0, 1]")->capture_default_str();
  cmd->add_option("--top-k", p.top_k, "Sample among the k most likely tokens; 0 = all")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", p.seed, "Random seed for sampling")->capture_default_str();
}

void add_speculate_options(CLI::App* cmd, SpeculateOptions& o) {
  static const std::map<std::string, DraftMethod> methods{
      {"none", DraftMethod::None}, {"ngram", DraftMethod::Ngram}, {"mtp", DraftMethod::Mtp}};
  cmd->add_option("--speculate", o.method,
                  "Speculative decoding: drafts verified in one forward (same output, fewer forwards when drafts are "
                  "kept). ngram = the tokens that followed the latest earlier occurrence of the last few tokens; "
                  "mtp = the checkpoint's MTP block guesses one token per step")
      ->transform(CLI::CheckedTransformer(methods))->default_str("none");
  cmd->add_option("--draft-tokens", o.max_draft, "Drafted tokens per step at most")
      ->capture_default_str()->check(CLI::Range(1, kMaxRollback));
  cmd->add_option("--ngram-max", o.ngram_max, "Longest n-gram looked up for drafts")
      ->capture_default_str()->check(CLI::Range(1, 16));
}

}  // namespace dsv4::cli
