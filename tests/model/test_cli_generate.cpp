// SPDX-License-Identifier: MIT
// `dsv4 generate` end to end through the real binary on the embedded tiny model: JSON output, --logits-out
// layout (row i = logits after token i, equal to the library's), and clear non-zero exits on bad input.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "run_cli.h"
#include "io/npy.h"
#include "model/session.h"

namespace fs = std::filesystem;
using namespace dsv4;

namespace {

using dsv4::testing::RunResult;
RunResult run(const std::string& args) { return dsv4::testing::run_dsv4(args); }

const std::string kTiny = std::string(DSV4_SOURCE_DIR) + "/models/tiny";

}  // namespace

TEST(CliGenerate, JsonAndLogitsOutMatchTheLibrary) {
  const fs::path npy = fs::temp_directory_path() / "dsv4_cli_logits.npy";
  const RunResult r = run("generate --model " + kTiny + " --prompt-ids 5,17,99,42 --max-new-tokens 6 --ignore-eos "
                          "--json --logits-out " + npy.string());
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  EXPECT_EQ(j["prompt_ids"].get<std::vector<int>>(), (std::vector<int>{5, 17, 99, 42}));
  const auto output = j["output_ids"].get<std::vector<int32_t>>();
  ASSERT_EQ(output.size(), 6u);

  const Model model = Model::load(kTiny);
  const auto runner = make_cpu_runner(model, 64);
  Session session(*runner);
  GenerateOptions options;
  options.max_new_tokens = 6;
  options.stop_at_eos = false;
  options.keep_logits = true;
  const GenerateResult ref = session.generate(std::vector<int32_t>{5, 17, 99, 42}, options);
  EXPECT_EQ(output, ref.output_ids);
  const NpyArray logits = read_npy(npy.string());
  ASSERT_EQ(logits.shape, (std::vector<int64_t>{4 + 6 - 1, model.config().vocab_size}));
  for (size_t i = 0; i < ref.logits.size(); ++i) ASSERT_EQ(float(logits.values[i]), ref.logits[i]) << i;
  fs::remove(npy);
}

// --speculate ngram prints the tokens plain decoding prints (sampled, so the given-back draws are exercised too) and
// says how many drafts it kept.
TEST(CliGenerate, SpeculationPrintsThePlainOutput) {
  const std::string args = "generate --model " + kTiny + " --prompt-ids 5,17,99,42,5,17,99,42 --max-new-tokens 60 "
                           "--ignore-eos --temperature 0.6 --seed 9 --json";
  const RunResult plain = run(args), spec = run(args + " --speculate ngram --draft-tokens 6");
  ASSERT_EQ(plain.exit_code, 0) << plain.out;
  ASSERT_EQ(spec.exit_code, 0) << spec.out;
  const auto ids = [](const std::string& out) {
    return nlohmann::json::parse(out.substr(out.find('{')))["output_ids"].get<std::vector<int32_t>>();
  };
  EXPECT_EQ(ids(spec.out), ids(plain.out));
  EXPECT_NE(spec.out.find("drafted tokens kept"), std::string::npos) << spec.out;
}

// --prompt-file: the file's text (or standard input's for -) is the prompt, the same ids as --prompt gives; a prompt
// longer than one command-line argument may be (Linux: 128 KB) arrives whole (here stopped by the context check,
// which counts its tokens); an unreadable or empty file and two prompt options at once are clear errors.
TEST(CliGenerate, PromptFromAFileOrStandardInput) {
  const fs::path file = fs::temp_directory_path() / "dsv4_cli_prompt.txt";
  std::ofstream(file) << "Hello world";
  const std::string base = "generate --model " + kTiny + " --max-new-tokens 2 --json ";
  const auto prompt_ids = [](const RunResult& r) {
    return nlohmann::json::parse(r.out.substr(r.out.find('{')))["prompt_ids"].get<std::vector<int32_t>>();
  };
  const RunResult inline_text = run(base + "--prompt \"Hello world\"");
  const RunResult from_file = run(base + "--prompt-file " + file.string());
  const RunResult from_stdin = run(base + "--prompt-file - < " + file.string());
  ASSERT_EQ(inline_text.exit_code, 0) << inline_text.out;
  ASSERT_EQ(from_file.exit_code, 0) << from_file.out;
  ASSERT_EQ(from_stdin.exit_code, 0) << from_stdin.out;
  EXPECT_EQ(prompt_ids(from_file), prompt_ids(inline_text));
  EXPECT_EQ(prompt_ids(from_stdin), prompt_ids(inline_text));

  std::string large;
  for (int i = 0; i < 20000; ++i) large += "hello world ";  // 240 KB: 100001 tokens on the tiny tokenizer + BOS
  std::ofstream(file) << large;
  const RunResult too_long = run("generate --model " + kTiny + " --max-context 1000 --prompt-file " + file.string());
  EXPECT_NE(too_long.exit_code, 0);
  EXPECT_NE(too_long.out.find("the prompt (100002 tokens"), std::string::npos) << too_long.out;

  std::ofstream(file, std::ios::trunc).flush();
  const std::vector<std::pair<std::string, std::string>> errors = {
      {base + "--prompt-file " + file.string(), "the prompt is empty"},
      {base + "--prompt-file /nonexistent/prompt.txt", "cannot open the file"},
      {base + "--prompt \"\"", "--prompt is empty"},
      {base + "--prompt x --prompt-file " + file.string(), "excludes"},
      {base + "--prompt-ids 1 --prompt-file " + file.string(), "excludes"},
  };
  for (const auto& [args, message] : errors) {
    const RunResult r = run(args);
    EXPECT_NE(r.exit_code, 0) << args;
    EXPECT_NE(r.out.find(message), std::string::npos) << args << "\n" << r.out;
  }
  fs::remove(file);
}

TEST(CliGenerate, TextPromptStreamsText) {
  const RunResult r = run("generate --model " + kTiny + " --prompt \"Hello world\" --max-new-tokens 4 --json");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("\"text\""), std::string::npos) << r.out;
}

TEST(CliGenerate, BadInputGivesClearErrorAndNonZeroExit) {
  struct Case {
    std::string args, message;
  };
  const std::vector<Case> cases = {
      {"generate --model /nonexistent --prompt-ids 1", "/nonexistent/config.json"},
      {"generate --model " + kTiny + " --prompt-ids 1,x", "not an integer token id"},
      {"generate --model " + kTiny + " --prompt-ids 1,99999", "outside the vocabulary"},
      {"generate --model " + kTiny + " --prompt-ids 1,2,3,4,5 --max-context 3", "longer than the context"},
      {"generate --model " + kTiny + " --prompt-ids 1 --kv-dtype fp16", "kv-dtype"},
      {"generate --model " + kTiny, "--prompt-ids, --prompt or --prompt-file"},
      {"generate --model " + kTiny + " --prompt-ids 1 --speculate eagle", "--speculate"},
      {"generate --model " + kTiny + " --prompt-ids 1 --speculate ngram --draft-tokens 0", "--draft-tokens"},
      {"generate --model " + kTiny + " --prompt-ids 1 --gpus 0,1", "--gpus 0,1 needs --device cuda"},
      {"generate --model " + kTiny + " --prompt-ids 1 --cuda-prefill-chunk 1024", "needs --device cuda"},
      {"generate --model " + kTiny + " --prompt-ids 1 --cuda-prefill-chunk 100", "multiple of 64 in [64, 4096]"},
      {"generate --model " + kTiny + " --prompt-ids 1 --cuda-prefill-chunk 8192", "multiple of 64 in [64, 4096]"},
      {"generate --model " + kTiny + " --prompt-ids 1 --cpu-weights fp16", "--cpu-weights"},
  };
  for (const Case& c : cases) {
    const RunResult r = run(c.args);
    EXPECT_NE(r.exit_code, 0) << c.args;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.args << "\n" << r.out;
  }
}

TEST(CliGenerate, ConfigThatDoesNotMatchTheWeightsNamesTheTensor) {
  const fs::path dir = fs::temp_directory_path() / "dsv4_mismatch_model";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::create_symlink(fs::path(kTiny) / "model.safetensors", dir / "model.safetensors");
  auto config = nlohmann::json::parse(std::ifstream(fs::path(kTiny) / "config.json"));
  config["q_lora_rank"] = 48;
  std::ofstream(dir / "config.json") << config.dump();
  const RunResult r = run("generate --model " + dir.string() + " --prompt-ids 1,2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("wq_a.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("expected shape [48, 64]"), std::string::npos) << r.out;
  fs::remove_all(dir);
}
