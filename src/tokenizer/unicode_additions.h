// SPDX-License-Identifier: MIT
// Code points HF's regex engine (Oniguruma in tokenizers 0.23.2, Unicode 16.0) puts in \p{L}, \p{M},
// \p{N}, \p{P} and \p{S} but Debian 12's PCRE2 10.42 (Unicode 14.0) does not know yet: the characters
// assigned in Unicode 15.0-16.0. Nothing moved the other way and \p{Z} / White_Space are equal.
//
// Measured, not typed: tools/tokref/unicode_classes.mjs lists each class as HF's binding sees it over
// all code points and the test TokenizerReference.UnicodeClassesMatchHfRegexEngine checks that the
// PCRE2 classes, extended with these ranges, equal it code point for code point.
#pragma once
#include <string_view>

namespace dsv4 {

struct UnicodeClassExtension {
  char property;                // the X of \p{X}
  std::string_view extra;       // PCRE2 class fragment (ranges) to add
};

inline constexpr UnicodeClassExtension kUnicode16Additions[] = {
    {'L',
    "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}"
    "\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}"
    "\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}"
    "\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}"
    "\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}"
    "\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}"
    "\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}"
    "\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}"},
    {'M',
    "\\x{897}\\x{CF3}\\x{ECE}\\x{10D69}-\\x{10D6D}\\x{10EFC}-\\x{10EFF}\\x{11241}"
    "\\x{113B8}-\\x{113C0}\\x{113C2}\\x{113C5}\\x{113C7}-\\x{113CA}\\x{113CC}-\\x{113D0}"
    "\\x{113D2}\\x{113E1}-\\x{113E2}\\x{11F00}-\\x{11F01}\\x{11F03}\\x{11F34}-\\x{11F3A}"
    "\\x{11F3E}-\\x{11F42}\\x{11F5A}\\x{13440}\\x{13447}-\\x{13455}\\x{1611E}-\\x{1612F}"
    "\\x{1E08F}\\x{1E4EC}-\\x{1E4EF}\\x{1E5EE}-\\x{1E5EF}"},
    {'N',
    "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
    "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}"
    "\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}"},
    {'P',
    "\\x{1B4E}-\\x{1B4F}\\x{1B7F}\\x{10D6E}\\x{113D4}-\\x{113D5}\\x{113D7}-\\x{113D8}"
    "\\x{11B00}-\\x{11B09}\\x{11BE1}\\x{11F43}-\\x{11F4F}\\x{16D6D}-\\x{16D6F}\\x{1E5FF}"},
    {'S',
    "\\x{2427}-\\x{2429}\\x{2FFC}-\\x{2FFF}\\x{31E4}-\\x{31E5}\\x{31EF}\\x{10D8E}-\\x{10D8F}"
    "\\x{1CC00}-\\x{1CCEF}\\x{1CD00}-\\x{1CEB3}\\x{1F6DC}\\x{1F774}-\\x{1F776}"
    "\\x{1F77B}-\\x{1F77F}\\x{1F7D9}\\x{1F8B2}-\\x{1F8BB}\\x{1F8C0}-\\x{1F8C1}"
    "\\x{1FA75}-\\x{1FA77}\\x{1FA87}-\\x{1FA89}\\x{1FA8F}\\x{1FAAD}-\\x{1FAAF}"
    "\\x{1FABB}-\\x{1FABF}\\x{1FAC6}\\x{1FACE}-\\x{1FACF}\\x{1FADA}-\\x{1FADC}\\x{1FADF}"
    "\\x{1FAE8}-\\x{1FAE9}\\x{1FAF7}-\\x{1FAF8}\\x{1FBCB}-\\x{1FBEF}"},
};

}  // namespace dsv4
