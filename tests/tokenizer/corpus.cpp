// SPDX-License-Identifier: MIT
#include "corpus.h"

#include <random>
#include <string_view>

#include "tokenizer/utf8.h"

namespace dsv4::testing {

namespace {

using Pool = std::vector<std::string>;

std::string cp(char32_t c) {
  std::string s;
  utf8::append(s, c);
  return s;
}

const Pool kWords = {"the", "quick", "brown", "fox", "Hello", "world", "DeepSeek", "tokenizer", "I'm", "don't",
                     "can't", "they're", "we've", "it'll", "he'd", "OK", "HTTP", "JSON", "x", "a", "A", "naïve",
                     "café", "Straße", "über", "résumé", "ℕ", "ﬁle", "MiXeD", "CamelCase", "snake_case", "e\u0301",
                     "'s", "'S", "'ll", "O'Neil", "rock'n'roll", "U.S.A.", "e-mail", "a.b.c"};
const Pool kPunct = {".",  ",",  "!",  "?",  ";",  ":",  "...", "—",  "–",  "“",  "”",  "‘",  "’",  "«",  "»",
                     "(",  ")",  "[",  "]",  "{",  "}",  "<",   ">",  "/",  "\\", "|",  "@",  "#",  "$",  "%",
                     "^",  "&",  "*",  "_",  "+",  "=",  "~",   "`",  "'",  "\"", "-",  "。", "，", "、", "！",
                     "？", "：", "；", "「", "」", "【", "】",  "《", "》", "…",  "§",  "©",  "®",  "°",  "±",
                     "€",  "£",  "¥",  "→",  "⇒",  "∑",  "√",   "∞",  "≤",  "♥",  "★",  "☃",  "※",  "〜", "・"};
const Pool kSpaces = {" ",      "  ",     "\t",     "\n",     "\r\n",   "\r",     "\n\n",   "\u00A0", "\u3000",
                      "\u2028", "\u2029", "\u180E", "\u200B", "\u2009", "\u000B", "\u000C", "\u0085", "    ",
                      "\t\t",   " \n ",   "\n\t",   "\u202F", "\u205F", "\u1680", "\uFEFF", "\u200D", "   \r\n"};
const Pool kEmoji = {"😀", "👍🏽", "👨‍👩‍👧‍👦", "🇨🇳", "🇺🇸", "🏳️‍🌈", "❤️", "✅", "1️⃣", "🤖", "🙏🏿", "🧑‍💻", "😂😂", "🔥", "🀄", "🂡"};
const Pool kCode = {"def f(x):\n    return x**2\n",
                    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
                    "#include <vector>\n",
                    "std::vector<int> v{1,2,3};",
                    "SELECT * FROM t WHERE id=42;",
                    "<div class=\"a\">b</div>",
                    "$ ls -la | grep foo > out.txt 2>&1",
                    "x := 0x1F; y = 3.14e-10",
                    "// comment\n",
                    "/* block */",
                    "if a==b and c!=d:\n        pass",
                    "{\"key\": [1, 2.5, null, true], \"k2\": {}}",
                    "fn main() -> Result<(), Box<dyn Error>> {",
                    "    let s = \"héllo\";\r\n",
                    "lambda x: x if x else None",
                    "a+=1;b-=2;c*=3;d/=4;",
                    "https://example.com/path?q=1&r=%20#frag",
                    "C:\\Users\\x\\file.txt",
                    "@decorator\nclass A(B):\n\t\"\"\"doc\"\"\"",
                    "\t\t\treturn;\n\n\n"};
const Pool kSpecial = {
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>", "<|EOT|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "<｜fim▁hole｜>", "<｜place▁holder▁no▁17｜>",
    "<｜place▁holder▁no▁799｜>", "<think>", "</think>", "｜DSML｜", "<｜DSML｜invoke name=\"f\">",
    "</｜DSML｜parameter>", "<｜latest_reminder｜>", "<｜action｜>", "<｜image｜>", "<｜mm▁placeholder▁3｜>",
    "<｜deepseek_image｜>", "<｜end_of_query｜>", "<｜User", "｜>", "<think", "</thin", "<｜begin▁of▁sentence",
    "｜DSML", "<|EOT|", "[LS]", "[RS]", "[LRS]", "hello", "wörd", "<｜User｜>!", "<｜begin", "©",
    "<<think>>", "<｜<｜User｜>｜>", "<tool_result>", "</tool_result>"};

// Random code point from [lo, hi].
char32_t pick(std::mt19937_64& rng, char32_t lo, char32_t hi) {
  return static_cast<char32_t>(std::uniform_int_distribution<uint32_t>(lo, hi)(rng));
}

std::string random_script_run(std::mt19937_64& rng) {
  // Blocks: [lo, hi] of several scripts (CJK inside and outside the pre-tokenizer's 一-龥 range).
  static const std::vector<std::pair<char32_t, char32_t>> kBlocks = {
      {0x4E00, 0x9FA5}, {0x9FA6, 0x9FFF}, {0x3400, 0x4DBF}, {0x20000, 0x2A6DF}, {0x3041, 0x3096}, {0x30A1, 0x30FF},
      {0xFF66, 0xFF9D}, {0xAC00, 0xD7A3}, {0x1100, 0x11FF}, {0x0400, 0x04FF}, {0x0370, 0x03FF}, {0x0600, 0x06FF},
      {0x05D0, 0x05EA}, {0x0900, 0x097F}, {0x0E00, 0x0E5B}, {0x0B80, 0x0BFF}, {0x10A0, 0x10FF}, {0x0530, 0x058F},
      {0x1200, 0x137F}, {0x00C0, 0x024F}, {0x0300, 0x036F}, {0xFF10, 0xFF5A}, {0x2160, 0x2188}, {0x2460, 0x24FF},
      {0x0660, 0x0669}, {0x1F300, 0x1F6FF}, {0x2E80, 0x2FDF}, {0x3100, 0x312F}, {0xA000, 0xA48F}, {0x1D400, 0x1D7FF}};
  const auto& [lo, hi] = kBlocks[rng() % kBlocks.size()];
  std::string s;
  const int n = 1 + static_cast<int>(rng() % 8);
  for (int i = 0; i < n; ++i) s += cp(pick(rng, lo, hi));
  return s;
}

std::string random_digits(std::mt19937_64& rng) {
  std::string s;
  const int n = 1 + static_cast<int>(rng() % 15);
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>('0' + rng() % 10));
  return s;
}

std::string random_unit(std::mt19937_64& rng, int style) {
  // style biases the mix: 0 prose, 1 CJK-heavy, 2 code, 3 whitespace/digits, 4 specials, 5 emoji
  static const int kWeights[6][8] = {
      // words punct spaces digits script emoji code special
      {40, 15, 25, 5, 5, 2, 1, 2}, {5, 15, 10, 10, 55, 2, 1, 2},  {10, 20, 20, 10, 2, 1, 35, 2},
      {5, 5, 50, 35, 2, 1, 1, 1},  {15, 10, 15, 5, 10, 2, 3, 40}, {15, 10, 15, 5, 10, 40, 1, 4}};
  int total = 0;
  for (int w : kWeights[style]) total += w;
  int r = static_cast<int>(rng() % total);
  int k = 0;
  while (r >= kWeights[style][k]) r -= kWeights[style][k++];
  switch (k) {
    case 0: return kWords[rng() % kWords.size()];
    case 1: return kPunct[rng() % kPunct.size()];
    case 2: return kSpaces[rng() % kSpaces.size()];
    case 3: return random_digits(rng);
    case 4: return random_script_run(rng);
    case 5: return kEmoji[rng() % kEmoji.size()];
    case 6: return kCode[rng() % kCode.size()];
    default: return kSpecial[rng() % kSpecial.size()];
  }
}

std::string random_mixed(std::mt19937_64& rng) {
  const int style = static_cast<int>(rng() % 6);
  const int n = 1 + static_cast<int>(rng() % 60);
  std::string s;
  for (int i = 0; i < n; ++i) s += random_unit(rng, style);
  return s;
}

std::string random_codepoints(std::mt19937_64& rng) {
  const int n = 1 + static_cast<int>(rng() % 40);
  std::string s;
  for (int i = 0; i < n; ++i) {
    const uint64_t r = rng() % 100;
    char32_t c;
    if (r < 45) {
      c = pick(rng, 0x80, 0xFFFD);
    } else if (r < 75) {
      c = pick(rng, 0x10000, 0x3FFFF);
    } else if (r < 85) {
      c = pick(rng, 0xE0000, 0x10FFFF);
    } else {
      c = pick(rng, 0x20, 0x7E);
    }
    if (c >= 0xD800 && c <= 0xDFFF) c = 0xFFFD;
    s += cp(c);
    if (rng() % 4 == 0) s += kSpaces[rng() % 3];
  }
  return s;
}

std::string insert_invalid(std::mt19937_64& rng, std::string s) {
  static const std::vector<std::string> kBad = {
      "\x80", "\xBF", "\xC0", "\xC1", "\xF5", "\xFF", "\xC3",            // lone/forbidden bytes, truncated 2-byte
      "\xE4\xBD", "\xF0\x9F\x98", "\xF0\x9F", "\xC0\xAF", "\xE0\x80\xAF", // truncated, overlong
      "\xED\xA0\x80", "\xED\xBF\xBF", "\xF4\x90\x80\x80", "\xF8\x88\x80\x80\x80", "\xFE\xFE",
      "\xE4\xBD\xE4\xBD\xA0", "\xC3\x28", "\xE2\x82\x28"};
  const int n = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < n; ++i) {
    const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
    std::string bad = kBad[rng() % kBad.size()];
    if (rng() % 5 == 0) bad = std::string(1, static_cast<char>(rng() % 256));
    s.insert(pos, bad);
  }
  return s;
}

std::vector<CorpusEntry> hand_written() {
  std::vector<CorpusEntry> v;
  auto add = [&](std::string s) { v.push_back({"hand-written", std::move(s)}); };
  add("");
  add("Hello, world!");
  add("Hello world 12345678 你好世界，今天是2024年12月26日。");
  add("<｜begin▁of▁sentence｜><｜User｜>1+1=?<｜Assistant｜>");
  add("<｜begin▁of▁sentence｜>You are helpful.<｜User｜>1+1=?<｜Assistant｜>2<｜end▁of▁sentence｜>");
  add("The quick brown fox jumps over the lazy dog.");
  add("日本語のテキストとカタカナ、ひらがな。東京タワーは333メートル。");
  add("한국어 텍스트입니다. 안녕하세요!");
  add("Привет, мир! Ελληνικά. العربية مَرْحَبًا. עברית. हिन्दी में लिखा। ไทย ภาษา");
  add("emoji: 👨‍👩‍👧‍👦 👍🏽 🇨🇳🇺🇸 🏳️‍🌈 ❤️ 1️⃣");
  add("e\u0301 a\u0308 n\u0303 combining\u0301\u0302\u0303 marks");
  add("ＦＵＬＬ－ｗｉｄｔｈ　１２３４５　テスト");
  add("Ⅻ ① ² ½ ٣٤٥ ४२ 𝟘𝟙𝟚");
  add("a\u180Eb \u180E c\u180E\u180E d \u180E");
  add("tabs\tand\t\tspaces   and\nnewlines\r\n\r\nand\rcarriage");
  add("   leading and trailing   ");
  add("\n\n\n");
  add(" ");
  add("\t");
  add("0");
  add("00000000000000000000000000000000000000001");
  add("3.14159265358979323846264338327950288419716939937510");
  add("1,234,567.89 and 1.234.567,89 and 1 234 567");
  add("def f(x):\n    return x**2\n\n\nclass A:\n\tpass\n");
  add("<think>reasoning</think>answer<｜end▁of▁sentence｜>");
  add("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"location\" "
      "string=\"true\">Beijing</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
  add("<tool_result>{\"temperature\": 22}</tool_result>");
  add("<<｜User｜>><｜User｜><｜User｜>｜User｜<｜User <｜User｜");
  add("[LS]   [RS]   [LRS]  x  [LS][RS] hello  hello,hello wörd wördx xwörd <｜User｜>!!");
  add("<｜begin<｜begin▁of▁sentence｜><｜begin▁of▁sentence<｜begin▁of▁sentence｜>>");
  add("©©©©©");
  add("\u00A0\u00A0x\u3000\u3000y\u2028z\u2029");
  add("I'm you're he's she'd we'll they've I'M YOU'RE");
  add("𠀀𠀁𪜀 𫝀𬺰 (CJK extension B-F)");
  add("\U00031350\U00031351 \U0002EBF0 \U00011F00\U00011F01 (newer Unicode)");
  add("\U000E0001\U000E0020\U000E007F tags \U000F0000 private \uE000");
  add("\x01\x02\x03\x7F control \x1B[31mred\x1B[0m");
  add(std::string("nul\0inside", 10));
  return v;
}

}  // namespace

std::string make_natural_text(size_t n_bytes, uint64_t seed) {
  // Paragraphs as chat and code traffic looks: English prose (words, numbers, punctuation, now and
  // then a name with diacritics), source code, Chinese and Japanese sentences, a little emoji.
  static const Pool kProse = {"the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
                              "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
                              "an", "they", "you", "were", "their", "one", "all", "we", "can", "her", "has", "there",
                              "model", "tokenizer", "attention", "memory", "inference", "request", "latency",
                              "throughput", "DeepSeek", "GPU", "kernel", "expert", "routing", "sequence", "cache",
                              "don't", "it's", "we're", "café", "naïve", "Zürich", "São", "Paulo", "résumé"};
  static const Pool kEnd = {".", ".", ".", "!", "?", ":", ";"};
  std::mt19937_64 rng(seed);
  std::string s;
  while (s.size() < n_bytes) {
    const uint64_t kind = rng() % 10;
    if (kind < 5) {  // English paragraph
      for (int sentence = 0, n = 2 + static_cast<int>(rng() % 5); sentence < n; ++sentence) {
        for (int w = 0, m = 6 + static_cast<int>(rng() % 14); w < m; ++w) {
          std::string word = rng() % 12 == 0 ? std::to_string(rng() % 100000) : kProse[rng() % kProse.size()];
          if (w == 0 && word[0] >= 'a' && word[0] <= 'z') word[0] = static_cast<char>(word[0] - 32);
          s += word;
          s += w + 1 == m ? kEnd[rng() % kEnd.size()] : rng() % 9 == 0 ? ", " : " ";
        }
        s += " ";
      }
      s += rng() % 20 == 0 ? kEmoji[rng() % kEmoji.size()] + "\n\n" : "\n\n";
    } else if (kind < 7) {  // code
      s += "```\n";
      for (int l = 0, n = 3 + static_cast<int>(rng() % 8); l < n; ++l) s += kCode[rng() % kCode.size()] + "\n";
      s += "```\n\n";
    } else if (kind < 9) {  // Chinese / Japanese prose
      static const Pool kCjkPunct = {"，", "。", "、", "：", "！", "？"};
      for (int clause = 0, n = 3 + static_cast<int>(rng() % 6); clause < n; ++clause) {
        for (int c = 0, m = 4 + static_cast<int>(rng() % 14); c < m; ++c) {
          s += rng() % 5 == 0 ? cp(pick(rng, 0x3041, 0x3093)) : cp(pick(rng, 0x4E00, 0x9FA5));
        }
        if (rng() % 6 == 0) s += std::to_string(rng() % 3000);
        s += kCjkPunct[rng() % kCjkPunct.size()];
      }
      s += "\n\n";
    } else {  // a list of numbers and short items
      for (int i = 0, n = 3 + static_cast<int>(rng() % 6); i < n; ++i) {
        s += "- " + kWords[rng() % kWords.size()] + ": " + std::to_string(rng() % 1000000) + "." +
             std::to_string(rng() % 100) + "\n";
      }
      s += "\n";
    }
  }
  s.resize(utf8::complete_prefix_length(std::string_view(s).substr(0, n_bytes)));
  return s;
}

std::vector<CorpusEntry> make_corpus(const CorpusOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<CorpusEntry> v = hand_written();
  for (const auto& s : kSpecial) v.push_back({"special string", s});
  for (const auto& s : kCode) v.push_back({"code", s});
  for (int n = 1; n <= 40; ++n) v.push_back({"digit run", std::string(n, '7')});
  for (int n = 1; n <= 24; ++n) {
    v.push_back({"space run", std::string(n, ' ') + "x"});
    v.push_back({"space run", "x" + std::string(n, ' ')});
    v.push_back({"whitespace run", std::string(n, '\n') + std::string(n % 5, ' ') + "y"});
  }
  for (int i = 0; i < o.n_random_mixed; ++i) v.push_back({"random mixed", random_mixed(rng)});
  for (int i = 0; i < o.n_random_codepoints; ++i) v.push_back({"random code points", random_codepoints(rng)});
  for (int i = 0; i < o.n_invalid; ++i) v.push_back({"invalid UTF-8", insert_invalid(rng, random_mixed(rng))});
  // Dense combinations of the character kinds the word regex distinguishes, ASCII and the
  // non-ASCII characters that continue its runs (letter, mark, symbol, spaces).
  static const Pool kDense = {"a", "Z", "q", " ", " ", "\t", "\n", "\r", "\v", "\f", "!", ".", "$", "'", "1", "\x01",
                              "\x7F", "é", "\u0301", "\u00A0", "\u3000", "\u0085", "中", "€", "™", "　", "\u2028"};
  for (int i = 0; i < o.n_dense; ++i) {
    std::string t;
    for (int k = 0, len = 1 + static_cast<int>(rng() % 24); k < len; ++k) t += kDense[rng() % kDense.size()];
    v.push_back({"dense character mix", t});
  }

  const size_t n = o.long_bytes;
  v.push_back({"long natural text", make_natural_text(n, o.seed + 1)});
  v.push_back({"long letter run", std::string(n / 2, 'a')});
  v.push_back({"long digit run", std::string(n / 4, '9')});
  v.push_back({"long space run", std::string(n / 4, ' ') + "end"});
  std::string ws, cjk, specials, marks, emoji;
  while (ws.size() < n / 4) ws += kSpaces[rng() % kSpaces.size()];
  while (cjk.size() < n / 2) cjk += cp(pick(rng, 0x4E00, 0x9FA5));
  while (specials.size() < n / 4) specials += kSpecial[rng() % kSpecial.size()];
  while (marks.size() < n / 4) marks += "e\u0301\u0302";
  while (emoji.size() < n / 4) emoji += kEmoji[rng() % kEmoji.size()];
  v.push_back({"long whitespace mix", ws});
  v.push_back({"long CJK run", cjk});
  v.push_back({"long special-token mix", specials});
  v.push_back({"long combining-mark word", marks});
  v.push_back({"long emoji run", emoji});
  v.push_back({"long invalid UTF-8", insert_invalid(rng, make_natural_text(n / 4, o.seed + 2))});
  return v;
}

}  // namespace dsv4::testing
