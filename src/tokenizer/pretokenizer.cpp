// SPDX-License-Identifier: MIT
#include "tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "tokenizer/unicode_additions.h"
#include "tokenizer/utf8.h"

namespace dsv4 {

namespace {

// White_Space minus the ASCII/NEL part, which \p{Z} does not cover (U+180E is in neither).
constexpr std::string_view kSpaceInClass = "\\t-\\r\\x{85}\\p{Z}";

// The ByteLevel pre-tokenizer's own split (GPT-2), used when "use_regex" is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Ranges to add to \p{name} so PCRE2 agrees with HF's newer Unicode tables ("" when none).
std::string_view unicode_additions(std::string_view name) {
  for (const auto& e : kUnicode16Additions) {
    if (name.size() == 1 && name[0] == e.property) return e.extra;
  }
  return {};
}

std::string escape_literal(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (std::string_view("\\^$.|?*+()[]{}-").find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

// The third Split of the DeepSeek V3/V4 pre-tokenizer, as tokenizer.json spells it.
constexpr std::string_view kDeepSeekWordPattern =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

// An exact ASCII-only evaluation of kDeepSeekWordPattern at one position, which avoids a PCRE2 call
// per match on the common case (this regex dominates encode time). Whenever the answer depends on a
// non-ASCII character (a letter run that continues into "é", a space run into U+3000, ...) it gives
// up and the caller asks PCRE2. The alternatives are tried in the regex's order, first match wins.
enum class Fast { kMatch, kNoMatchHere, kAskRegex };

bool ascii_letter(unsigned char c) { return (c | 0x20) >= 'a' && (c | 0x20) <= 'z'; }
bool ascii_punct(unsigned char c) {  // all 32 are in \p{P} or \p{S}
  return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') || (c >= '{' && c <= '~');
}
bool ascii_space(unsigned char c) { return c == ' ' || (c >= '\t' && c <= '\r'); }
bool crlf(unsigned char c) { return c == '\r' || c == '\n'; }

Fast deepseek_word_match(std::string_view s, size_t i, size_t& end) {
  const size_t n = s.size();
  auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = at(i);
  if (c >= 0x80) return Fast::kAskRegex;
  const bool has_next = i + 1 < n;
  const unsigned char d = has_next ? at(i + 1) : 0;
  // 1. [punct][A-Za-z]+ (ASCII letters only, so no look beyond ASCII is needed)
  if (ascii_punct(c) && has_next && ascii_letter(d)) {
    end = i + 2;
    while (end < n && ascii_letter(at(end))) ++end;
    return Fast::kMatch;
  }
  // 2. [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
  size_t run = n;  // start of the letter run, if any
  if (ascii_letter(c)) {
    run = i;
  } else if (!crlf(c) && !ascii_punct(c)) {  // c can be the optional prefix
    if (has_next && d >= 0x80) return Fast::kAskRegex;
    if (has_next && ascii_letter(d)) run = i + 1;
  }
  if (run < n) {
    end = run + 1;
    while (end < n && ascii_letter(at(end))) ++end;
    if (end < n && at(end) >= 0x80) return Fast::kAskRegex;  // a mark or letter may continue the run
    return Fast::kMatch;
  }
  // 3. " ?[\p{P}\p{S}]+[\r\n]*"
  size_t punct = n;
  if (ascii_punct(c)) {
    punct = i;
  } else if (c == ' ' && has_next) {
    if (d >= 0x80) return Fast::kAskRegex;
    if (ascii_punct(d)) punct = i + 1;
  }
  if (punct < n) {
    end = punct + 1;
    while (end < n && ascii_punct(at(end))) ++end;
    if (end < n && at(end) >= 0x80) return Fast::kAskRegex;  // a non-ASCII symbol may continue the run
    while (end < n && crlf(at(end))) ++end;
    return Fast::kMatch;
  }
  if (!ascii_space(c)) return Fast::kNoMatchHere;  // a digit or control character starts nothing
  // The white-space run [i, j); U+0085, NBSP, U+3000... would extend it, so stop at non-ASCII.
  size_t j = i + 1;
  while (j < n && ascii_space(at(j))) ++j;
  if (j < n && at(j) >= 0x80) return Fast::kAskRegex;
  // 4. \s*[\r\n]+ : up to the run's last CR/LF
  for (size_t k = j; k-- > i;) {
    if (crlf(at(k))) {
      end = k + 1;
      return Fast::kMatch;
    }
  }
  // 5. \s+(?!\S) : the run, minus its last character when something follows
  if (j == n) {
    end = j;
    return Fast::kMatch;
  }
  // 6. \s+
  end = j - 1 > i ? j - 1 : j;
  return Fast::kMatch;
}

// \p{N}{1,3}, the first Split of the DeepSeek pre-tokenizer, evaluated the same way: ASCII digits
// group in threes; a non-ASCII character (which may be a digit) goes to PCRE2.
constexpr std::string_view kDigitsPattern = "\\p{N}{1,3}";

Fast digits_match(std::string_view s, size_t i, size_t& end) {
  auto digit = [](unsigned char c) { return c >= '0' && c <= '9'; };
  const auto c = static_cast<unsigned char>(s[i]);
  if (c >= 0x80) return Fast::kAskRegex;
  if (!digit(c)) return Fast::kNoMatchHere;
  end = i + 1;
  while (end < s.size() && end - i < 3 && digit(static_cast<unsigned char>(s[end]))) ++end;
  if (end - i < 3 && end < s.size() && static_cast<unsigned char>(s[end]) >= 0x80) return Fast::kAskRegex;
  return Fast::kMatch;
}

// Per-thread PCRE2 scratch: one match data block (group 0 only is needed) and a JIT stack large
// enough for megabyte-long pieces.
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

}  // namespace

std::string rewrite_regex_for_pcre2(std::string_view p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 's') {
        out += in_class ? std::string(kSpaceInClass) : "[" + std::string(kSpaceInClass) + "]";
      } else if (d == 'S') {
        DSV4_CHECK(!in_class, "tokenizer regex `{}`: \\S inside a character class is not supported", p);
        out += "[^" + std::string(kSpaceInClass) + "]";
      } else if (d == 'p' || d == 'P') {
        // \p{X} / \pX: extend the general categories PCRE2's older Unicode tables lack.
        size_t end = i + 3;
        std::string_view name = p.substr(i + 2, 1);
        if (name == "{") {
          const size_t close = p.find('}', i + 3);
          DSV4_CHECK(close != std::string_view::npos, "tokenizer regex `{}`: unterminated \\p{{", p);
          name = p.substr(i + 3, close - i - 3);
          end = close + 1;
        }
        const std::string_view extra = unicode_additions(name);
        const std::string prop = fmt::format("\\p{{{}}}", name);
        if (extra.empty()) {
          out.append(p.substr(i, end - i));
        } else if (d == 'p') {
          out += in_class ? prop + std::string(extra) : "[" + prop + std::string(extra) + "]";
        } else {
          DSV4_CHECK(!in_class, "tokenizer regex `{}`: \\P{{{}}} inside a character class is not supported", p, name);
          out += "[^" + prop + std::string(extra) + "]";
        }
        i = end;
        continue;
      } else {
        // Oniguruma's \h is a hex digit, PCRE2's is horizontal space: refuse rather than differ.
        DSV4_CHECK(d != 'h' && d != 'H', "tokenizer regex `{}`: \\h/\\H differ between Oniguruma and PCRE2", p);
        out += c;
        out += d;
      }
      i += 2;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a leading ']' is a literal
      continue;
    }
    if (in_class) {
      // Oniguruma allows nested classes and && intersection; PCRE2 reads both literally.
      DSV4_CHECK(!(c == '[' && (i + 1 >= p.size() || p[i + 1] != ':')),
                 "tokenizer regex `{}`: nested character classes are not supported", p);
      DSV4_CHECK(!(c == '&' && i + 1 < p.size() && p[i + 1] == '&'),
                 "tokenizer regex `{}`: class intersection (&&) is not supported", p);
      if (c == ']') in_class = false;
    }
    out += c;
    ++i;
  }
  return out;
}

// One Split stage: a compiled regex and what to do with its matches.
class RegexSplitter {
 public:
  RegexSplitter(std::string_view hf_pattern, bool keep_matches)
      : keep_matches_(keep_matches),
        fast_path_(hf_pattern == kDeepSeekWordPattern ? deepseek_word_match
                   : hf_pattern == kDigitsPattern     ? digits_match
                                                      : nullptr) {
    const std::string pattern = rewrite_regex_for_pcre2(hf_pattern);
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      DSV4_FAIL("tokenizer regex `{}` does not compile with PCRE2 at offset {}: {}", hf_pattern, err_offset,
                reinterpret_cast<const char*>(msg));
    }
    jit_ = pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE) == 0;
  }
  ~RegexSplitter() { pcre2_code_free(code_); }
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // Appends the pieces of `piece` to out (gaps always, matches when keep_matches_).
  void split(std::string_view piece, std::vector<std::string_view>& out) const {
    const size_t n = piece.size();
    size_t prev = 0, pos = 0;
    while (pos < n || (pos == n && !fast_path_)) {
      size_t start = pos, end = pos;
      const Fast fast = fast_path_ ? fast_path_(piece, pos, end) : Fast::kAskRegex;
      if (fast == Fast::kNoMatchHere) {
        ++pos;
        continue;
      }
      if (fast == Fast::kAskRegex && !regex_match(piece, pos, start, end)) break;
      if (start > prev) out.push_back(piece.substr(prev, start - prev));
      if (keep_matches_ && end > start) out.push_back(piece.substr(start, end - start));
      prev = end;
      if (end > start) {
        pos = end;
      } else {  // empty match: step over one character, as Oniguruma's find_iter does
        if (end >= n) break;
        pos = end + utf8::next(piece.substr(end)).len;
      }
    }
    if (prev < n) out.push_back(piece.substr(prev));
  }

  // The leftmost match in piece at or after pos; false when there is none.
  bool regex_match(std::string_view piece, size_t pos, size_t& start, size_t& end) const {
    MatchScratch& s = scratch();
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
    const int rc = jit_ ? pcre2_jit_match(code_, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK, s.data, s.context)
                        : pcre2_match(code_, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK, s.data, s.context);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    DSV4_CHECK(rc >= 0, "tokenizer regex match failed with PCRE2 error {} on a {}-byte piece", rc, piece.size());
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
    start = ov[0], end = ov[1];
    return true;
  }

 private:
  pcre2_code* code_ = nullptr;
  bool jit_ = false;
  bool keep_matches_;
  // For the DeepSeek patterns: an exact ASCII evaluator tried before PCRE2 (nullptr otherwise).
  Fast (*fast_path_)(std::string_view, size_t, size_t&);
};

PreTokenizer::PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;
PreTokenizer::~PreTokenizer() = default;

PreTokenizer PreTokenizer::from_json(const nlohmann::json& spec) {
  PreTokenizer pt;
  std::vector<const nlohmann::json*> todo;
  if (!spec.is_null()) todo.push_back(&spec);
  // Flatten nested Sequences in order.
  std::vector<const nlohmann::json*> flat;
  while (!todo.empty()) {
    const nlohmann::json* j = todo.front();
    todo.erase(todo.begin());
    const std::string type = j->value("type", "");
    if (type == "Sequence") {
      const auto& list = j->at("pretokenizers");
      std::vector<const nlohmann::json*> inner;
      for (const auto& e : list) inner.push_back(&e);
      todo.insert(todo.begin(), inner.begin(), inner.end());
    } else {
      flat.push_back(j);
    }
  }
  for (const nlohmann::json* j : flat) {
    const std::string type = j->value("type", "");
    if (type == "Split") {
      const auto& pat = j->at("pattern");
      std::string regex;
      if (pat.contains("Regex")) {
        regex = pat.at("Regex").get<std::string>();
      } else if (pat.contains("String")) {
        regex = escape_literal(pat.at("String").get<std::string>());
      } else {
        DSV4_FAIL("tokenizer.json pre_tokenizer Split: pattern must have `Regex` or `String`, got {}", pat.dump());
      }
      const std::string behavior = j->value("behavior", "");
      DSV4_CHECK(behavior == "Isolated" || behavior == "Removed",
                 "tokenizer.json pre_tokenizer Split: behavior `{}` is not supported (expected Isolated or Removed)",
                 behavior);
      DSV4_CHECK(!j->value("invert", false), "tokenizer.json pre_tokenizer Split: invert=true is not supported");
      pt.stages_.push_back(std::make_unique<RegexSplitter>(regex, behavior == "Isolated"));
    } else if (type == "ByteLevel") {
      // The byte-to-unicode mapping itself happens in the BPE model, which works on raw bytes.
      DSV4_CHECK(!j->value("add_prefix_space", false),
                 "tokenizer.json pre_tokenizer ByteLevel: add_prefix_space=true is not supported");
      if (j->value("use_regex", true)) pt.stages_.push_back(std::make_unique<RegexSplitter>(kGpt2Pattern, true));
    } else {
      DSV4_FAIL("tokenizer.json pre_tokenizer type `{}` is not supported (expected Sequence, Split, ByteLevel)", type);
    }
  }
  return pt;
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  pieces.clear();
  if (text.empty()) return;
  pieces.push_back(text);
  std::vector<std::string_view> next;
  for (const auto& stage : stages_) {
    next.clear();
    for (std::string_view piece : pieces) stage->split(piece, next);
    pieces.swap(next);
  }
}

}  // namespace dsv4
