// SPDX-License-Identifier: MIT
// `dsv4 tokenize` prints the ids of a text (space-separated, or a JSON array with --json);
// `dsv4 detokenize` prints the text of comma/space-separated ids. --tokenizer takes a
// tokenizer.json or a model directory.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "core/check.h"
#include "tokenizer/tokenizer.h"

namespace dsv4::cli {

namespace {

struct TokenizeArgs {
  std::string tokenizer, text, file;
  bool json = false, no_special = false;
};

struct DetokenizeArgs {
  std::string tokenizer, ids;
  bool skip_special = false;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  DSV4_CHECK(in, "cannot open --file {}", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<int32_t> parse_ids(const std::string& s, int32_t vocab_size) {
  std::vector<int32_t> ids;
  std::string token;
  auto flush = [&] {
    if (token.empty()) return;
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(token, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DSV4_CHECK(used == token.size() && v >= 0 && v < vocab_size,
               "--ids: `{}` is not a token id (expected an integer in [0, {}))", token, vocab_size);
    ids.push_back(static_cast<int32_t>(v));
    token.clear();
  };
  for (char c : s) {
    if (c == ',' || c == ' ' || c == '\n' || c == '\t' || c == '[' || c == ']') {
      flush();
    } else {
      token.push_back(c);
    }
  }
  flush();
  return ids;
}

}  // namespace

void add_tokenize_commands(CLI::App& app, Handler& handler) {
  auto targs = std::make_shared<TokenizeArgs>();
  CLI::App* tok = app.add_subcommand("tokenize", "Print the token ids of a text");
  tok->add_option("--tokenizer", targs->tokenizer, "tokenizer.json or model directory")->required();
  auto* text_opt = tok->add_option("--text", targs->text, "text to encode");
  auto* file_opt = tok->add_option("--file", targs->file, "file whose bytes are encoded");
  text_opt->excludes(file_opt);
  tok->add_flag("--json", targs->json, "print a JSON array");
  tok->add_flag("--no-special", targs->no_special, "encode special-token strings as plain text");
  tok->callback([targs, text_opt, file_opt, &handler] {
    if (text_opt->count() == 0 && file_opt->count() == 0) throw CLI::RequiredError("--text or --file");
    handler = [targs] {
      const Tokenizer t = Tokenizer::load(targs->tokenizer);
      const std::string input = targs->file.empty() ? targs->text : read_file(targs->file);
      const std::vector<int32_t> ids = t.encode(input, !targs->no_special);
      std::string out = targs->json ? "[" : "";
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i) out += targs->json ? "," : " ";
        out += std::to_string(ids[i]);
      }
      if (targs->json) out += "]";
      std::printf("%s\n", out.c_str());
      return 0;
    };
  });

  auto dargs = std::make_shared<DetokenizeArgs>();
  CLI::App* detok = app.add_subcommand("detokenize", "Print the text of token ids");
  detok->add_option("--tokenizer", dargs->tokenizer, "tokenizer.json or model directory")->required();
  detok->add_option("--ids", dargs->ids, "ids, e.g. 1,2,3 or \"[1, 2, 3]\"")->required();
  detok->add_flag("--skip-special", dargs->skip_special, "drop special tokens");
  detok->callback([dargs, &handler] {
    handler = [dargs] {
      const Tokenizer t = Tokenizer::load(dargs->tokenizer);
      const std::string text = t.decode(parse_ids(dargs->ids, t.vocab_size()), dargs->skip_special);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fputc('\n', stdout);
      return 0;
    };
  });
}

}  // namespace dsv4::cli
