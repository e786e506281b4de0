// SPDX-License-Identifier: MIT
// Lists which code points HF tokenizers' regex engine puts in each Unicode class the DeepSeek
// pre-tokenizer uses (\p{L} \p{M} \p{N} \p{P} \p{S} \p{Z} \s), as the binding itself sees them:
// a Split pre-tokenizer with behavior "Removed" deletes the members from a string of all code
// points separated by U+0001 (a control character in none of the classes).
//
//   node unicode_classes.mjs OUT.json    -> {"L": [code points...], ...}
// Planes 4-13, 15 and 16 hold no assigned characters and are skipped (plane 14 has tags and
// variation selectors).
import fs from 'node:fs';
import tk from 'tokenizers';

const outPath = process.argv[2];
if (!outPath) {
  console.error('usage: node unicode_classes.mjs OUT.json');
  process.exit(2);
}
const classes = { L: '\\p{L}', M: '\\p{M}', N: '\\p{N}', P: '\\p{P}', S: '\\p{S}', Z: '\\p{Z}', s: '\\s' };
const planes = [0, 1, 2, 3, 14];
const out = {};
for (const [name, regex] of Object.entries(classes)) {
  const spec = {
    version: '1.0', truncation: null, padding: null, added_tokens: [], normalizer: null,
    pre_tokenizer: { type: 'Split', pattern: { Regex: regex }, behavior: 'Removed', invert: false },
    post_processor: null, decoder: null,
    model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null,
      end_of_word_suffix: null, fuse_unk: false, byte_fallback: false, vocab: {}, merges: [] },
  };
  const pre = tk.Tokenizer.fromString(JSON.stringify(spec)).getPreTokenizer();
  const members = [];
  for (const plane of planes) {
    const cps = [];
    let s = '';
    for (let c = plane * 0x10000; c < (plane + 1) * 0x10000; ++c) {
      if ((c >= 0xD800 && c <= 0xDFFF) || c === 1) continue;
      cps.push(c);
      s += String.fromCodePoint(c) + '\u0001';
    }
    const kept = new Set();
    for (const [piece] of pre.preTokenizeString(s)) {
      for (const ch of piece) kept.add(ch.codePointAt(0));
    }
    for (const c of cps) if (!kept.has(c)) members.push(c);
  }
  out[name] = members;
}
fs.writeFileSync(outPath, JSON.stringify(out));
