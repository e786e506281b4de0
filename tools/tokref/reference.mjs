// SPDX-License-Identifier: MIT
// Reference encoder/decoder for dsv4's tokenizer tests: HF tokenizers' own Node binding.
//
//   node reference.mjs TOKENIZER_JSON IN.jsonl OUT.jsonl
//
// Each input line is one request:
//   {"encode": "<base64 bytes>"}  -> {"ids": [...], "text": "<b64 decode(ids)>", "text_skip": "<b64 decode(ids, true)>"}
//   {"decode": [ids...]}          -> {"text": "<b64 decode(ids)>", "text_skip": "<b64 decode(ids, true)>"}
// Bytes become a JS string the WHATWG way (invalid UTF-8 -> U+FFFD per maximal subpart), which is
// the only way HF can see them. Output line i answers input line i.
import fs from 'node:fs';
import tk from 'tokenizers';

const [tokenizerPath, inPath, outPath] = process.argv.slice(2);
if (!outPath) {
  console.error('usage: node reference.mjs TOKENIZER_JSON IN.jsonl OUT.jsonl');
  process.exit(2);
}
const tokenizer = tk.Tokenizer.fromFile(tokenizerPath);
const b64 = (s) => Buffer.from(s, 'utf8').toString('base64');
const lines = fs.readFileSync(inPath, 'utf8').split('\n').filter((l) => l.length > 0);
const requests = lines.map((l) => JSON.parse(l));

const out = new Array(requests.length);
const encodeIdx = [];
const encodeText = [];
requests.forEach((r, i) => {
  if (r.encode !== undefined) {
    encodeIdx.push(i);
    encodeText.push(new TextDecoder('utf-8', { ignoreBOM: true }).decode(Buffer.from(r.encode, 'base64')));
  }
});
const BATCH = 256;
for (let k = 0; k < encodeText.length; k += BATCH) {
  const encs = await tokenizer.encodeBatch(encodeText.slice(k, k + BATCH), { addSpecialTokens: false });
  encs.forEach((e, j) => {
    out[encodeIdx[k + j]] = { ids: e.getIds() };
  });
}
for (let i = 0; i < requests.length; ++i) {
  const ids = requests[i].decode !== undefined ? requests[i].decode : out[i].ids;
  const text = await tokenizer.decode(ids, false);
  const textSkip = await tokenizer.decode(ids, true);
  out[i] = { ...(out[i] || {}), text: b64(text), text_skip: b64(textSkip) };
}
fs.writeFileSync(outPath, out.map((o) => JSON.stringify(o)).join('\n') + '\n');
