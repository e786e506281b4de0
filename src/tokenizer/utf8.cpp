// SPDX-License-Identifier: MIT
#include "tokenizer/utf8.h"

namespace dsv4::utf8 {

Step next(std::string_view s) {
  const auto b0 = static_cast<uint8_t>(s[0]);
  if (b0 < 0x80) return {Step::kValid, 1, b0};
  // Sequence length and the allowed range of the second byte (Unicode Table 3-7); the narrower
  // ranges exclude overlongs (E0, F0), surrogates (ED) and code points above U+10FFFF (F4).
  size_t n;
  uint8_t lo = 0x80, hi = 0xBF;
  char32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2, cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3, cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4, cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {Step::kInvalid, 1, 0};
  }
  for (size_t i = 1; i < n; ++i) {
    if (i >= s.size()) return {Step::kIncomplete, i, 0};
    const auto b = static_cast<uint8_t>(s[i]);
    const uint8_t l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return {Step::kInvalid, i, 0};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {Step::kValid, n, cp};
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    const Step st = next(s.substr(i));
    if (st.kind != Step::kValid) return false;
    i += st.len;
  }
  return true;
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto b = static_cast<uint8_t>(s[i]);
    if (b < 0x80) {
      out.push_back(s[i++]);
      continue;
    }
    const Step st = next(s.substr(i));
    if (st.kind == Step::kValid) {
      out.append(s.substr(i, st.len));
    } else {
      out.append("\xEF\xBF\xBD");
    }
    i += st.len;
  }
  return out;
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t complete_prefix_length(std::string_view s) {
  // Only the last 3 bytes can hold an incomplete sequence; find the last lead byte among them.
  const size_t first = s.size() > 3 ? s.size() - 3 : 0;
  for (size_t i = s.size(); i-- > first;) {
    const auto b = static_cast<uint8_t>(s[i]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for its lead
    if (b < 0x80) return s.size();
    return next(s.substr(i)).kind == Step::kIncomplete ? i : s.size();
  }
  return s.size();
}

}  // namespace dsv4::utf8
