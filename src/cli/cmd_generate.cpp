// SPDX-License-Identifier: MIT
// `dsv4 generate`: one prompt in, tokens out (greedy by default), optional logits dump as .npy.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/engine_options.h"
#include "core/check.h"
#include "io/npy.h"
#include "model/session.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {
namespace {

struct GenerateArgs {
  EngineOptions engine;
  SamplingParams sampling;
  SpeculateOptions speculate;
  std::string prompt_ids, prompt_text, prompt_file, logits_out, trace_dir;
  bool text_given = false;  // --prompt or --prompt-file (else --prompt-ids)
  int max_new_tokens = 16;
  bool json = false, ignore_eos = false;
};

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DSV4_CHECK(used == item.size() && !item.empty(), "--prompt-ids: \"{}\" is not an integer token id", item);
    DSV4_CHECK(v >= 0 && v <= INT32_MAX, "--prompt-ids: token id {} out of range", v);
    ids.push_back(int32_t(v));
  }
  DSV4_CHECK(!ids.empty(), "--prompt-ids is empty");
  return ids;
}

// The text of --prompt-file: the whole file, or standard input for "-" (a prompt longer than the 128 KB Linux allows
// one command-line argument).
std::string read_prompt_file(const std::string& path) {
  std::string text;
  if (path == "-") {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    DSV4_CHECK(!std::cin.bad(), "--prompt-file -: reading standard input failed");
  } else {
    std::ifstream in(path, std::ios::binary);
    DSV4_CHECK(in.good(), "--prompt-file {}: cannot open the file", path);
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    DSV4_CHECK(!in.bad(), "--prompt-file {}: reading the file failed", path);
  }
  DSV4_CHECK(!text.empty(), "--prompt-file {}: the prompt is empty", path);
  return text;
}

int run_generate(const GenerateArgs& a) {
  std::optional<Tokenizer> tokenizer;
  std::vector<int32_t> prompt;
  if (a.text_given) {
    const std::string text = a.prompt_file.empty() ? a.prompt_text : read_prompt_file(a.prompt_file);
    DSV4_CHECK(!text.empty(), "--prompt is empty");
    tokenizer = Tokenizer::load(a.engine.model_dir);
    if (tokenizer->add_bos_token() && tokenizer->bos_id()) prompt.push_back(*tokenizer->bos_id());
    const std::vector<int32_t> ids = tokenizer->encode(text);
    prompt.insert(prompt.end(), ids.begin(), ids.end());
  } else {
    prompt = parse_ids(a.prompt_ids);
  }
  Model model = load_model(a.engine);
  if (!a.trace_dir.empty()) {
    std::filesystem::create_directories(a.trace_dir);
    auto call = std::make_shared<int>(0);  // one file per forward call and tensor: <call>_<layer>_<name>.npy
    model.set_trace([dir = a.trace_dir, call](const std::string& name, int layer, const float* data, int rows,
                                             int cols) {
      if (name == "embed") ++*call;
      const std::string file = fmt::format("{}/{:04d}_{}_{}.npy", dir, *call - 1,
                                           layer < 0 ? std::string("model") : fmt::format("L{:02d}", layer), name);
      write_npy_f32(file, data, {rows, cols});
    });
  }
  std::unique_ptr<SequenceRunner> runner = runner_factory(model, a.engine)(a.engine.max_context);
  Session session(*runner);
  spdlog::info("sequence state: {:.1f} MiB for --max-context {}", runner->state_bytes() / 1048576.0,
               a.engine.max_context);

  GenerateOptions options;
  options.max_new_tokens = a.max_new_tokens;
  options.stop_at_eos = !a.ignore_eos;
  options.keep_logits = !a.logits_out.empty();
  options.sampling = a.sampling;
  options.speculate = a.speculate;
  std::optional<StreamDecoder> stream;
  if (tokenizer && !a.json) {
    stream.emplace(*tokenizer);
    options.on_token = [&](int32_t id) {
      std::fputs(stream->push(id).c_str(), stdout);
      std::fflush(stdout);
    };
  }
  const GenerateResult r = session.generate(prompt, options);

  if (!a.logits_out.empty())
    write_npy_f32(a.logits_out, r.logits.data(), {r.logit_rows, model.config().vocab_size});
  if (a.json) {
    nlohmann::ordered_json j;
    j["prompt_ids"] = prompt;
    j["output_ids"] = r.output_ids;
    if (tokenizer) j["text"] = tokenizer->decode(r.output_ids);
    std::printf("%s\n", j.dump().c_str());
  } else if (stream) {
    std::printf("%s\n", stream->finish().c_str());
  } else {
    std::string line;
    for (int32_t id : r.output_ids) line += (line.empty() ? "" : " ") + std::to_string(id);
    std::printf("%s\n", line.c_str());
  }
  // The first new token comes from the prefill; the decode steps produced the rest.
  const size_t decoded = r.output_ids.empty() ? 0 : r.output_ids.size() - 1;
  spdlog::info("prefill {} tokens in {:.3f} s ({:.1f} tok/s); decode {} tokens in {} steps, {:.3f} s ({:.1f} tok/s)",
               prompt.size(), r.prefill_seconds, prompt.size() / std::max(r.prefill_seconds, 1e-9), decoded,
               r.decode_steps, r.decode_seconds, decoded / std::max(r.decode_seconds, 1e-9));
  if (a.speculate.method != DraftMethod::None)
    spdlog::info("speculative decoding: {} of {} drafted tokens kept ({:.0f}%), {:.2f} tokens per step", r.accepted,
                 r.drafted, 100.0 * r.accepted / std::max(r.drafted, 1), double(decoded) / std::max(r.decode_steps, 1));
  return 0;
}

}  // namespace

void add_generate_command(CLI::App& app, Handler& handler) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate tokens from a prompt (greedy unless --temperature > 0)");
  add_engine_options(cmd, args->engine);
  auto* ids = cmd->add_option("--prompt-ids", args->prompt_ids, "Prompt as comma-separated token ids, e.g. 5,17,99");
  auto* text = cmd->add_option("--prompt", args->prompt_text, "Prompt text (tokenised with the model's tokenizer)");
  auto* file = cmd->add_option("--prompt-file", args->prompt_file,
                               "Prompt text read from this file, or from standard input for - (for prompts longer "
                               "than one command-line argument may be)");
  ids->excludes(text);
  ids->excludes(file);
  text->excludes(file);
  cmd->add_option("--max-new-tokens", args->max_new_tokens, "Number of tokens to generate")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  add_sampling_options(cmd, args->sampling);
  add_speculate_options(cmd, args->speculate);
  cmd->add_option("--logits-out", args->logits_out,
                  "Write float32 .npy [len(prompt)+len(output)-1, vocab]: row i = logits after token i");
  cmd->add_option("--trace-dir", args->trace_dir,
                  "Write every named intermediate (q, kv, attn_out, ...) of every forward call as .npy here");
  cmd->add_flag("--json", args->json, "Print {\"prompt_ids\":[...],\"output_ids\":[...]}");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Do not stop at the end-of-sequence token");
  cmd->callback([&handler, args, ids, text, file] {
    if (ids->count() == 0 && text->count() == 0 && file->count() == 0)
      throw CLI::RequiredError("--prompt-ids, --prompt or --prompt-file");
    args->text_given = text->count() > 0 || file->count() > 0;
    args->engine.with_mtp = args->speculate.method == DraftMethod::Mtp;
    handler = [args] { return run_generate(*args); };
  });
}

}  // namespace dsv4::cli
