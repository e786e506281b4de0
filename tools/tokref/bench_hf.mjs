// SPDX-License-Identifier: MIT
// HF tokenizers' encode throughput on the documents bench/tokenizer_bench wrote, one document at a
// time (await each encode, so the Rust side runs one encode at a time), best of 3 runs. Also
// checks that HF's ids equal the C++ ids the bench wrote.
//
//   node bench_hf.mjs TOKENIZER_JSON DOCS.txt IDS.txt
import fs from 'node:fs';
import tk from 'tokenizers';

const [tokenizerPath, docsPath, idsPath] = process.argv.slice(2);
const tokenizer = tk.Tokenizer.fromFile(tokenizerPath);
const docsBuf = fs.readFileSync(docsPath);
const docs = docsBuf.toString('utf8').split('\x1E');
docs.pop();
const ours = fs.readFileSync(idsPath, 'utf8').split('\n');
const bytes = docsBuf.length - docs.length;

let best = Infinity;
let bestCpu = Infinity;
let all = [];
for (let run = 0; run < 3; ++run) {
  const t0 = process.hrtime.bigint();
  const c0 = process.cpuUsage();
  const got = [];
  for (const d of docs) got.push((await tokenizer.encode(d, null, { addSpecialTokens: false })).getIds());
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  const c = process.cpuUsage(c0);
  const cpu = (c.user + c.system) / 1e6;  // all threads of the process: JS and the Rust worker
  if (s < best) best = s;
  if (cpu < bestCpu) bestCpu = cpu;
  all = got;
}
// The same documents in batches of 256 (one N-API call each), which removes most per-call overhead.
// Run with TOKENIZERS_PARALLELISM=false (bench/tokenizer_bench sets it) so Rust uses one thread.
let bestBatch = Infinity;
let bestBatchCpu = Infinity;
for (let run = 0; run < 3; ++run) {
  const t0 = process.hrtime.bigint();
  const c0 = process.cpuUsage();
  for (let k = 0; k < docs.length; k += 256) {
    await tokenizer.encodeBatch(docs.slice(k, k + 256), { addSpecialTokens: false });
  }
  const s = Number(process.hrtime.bigint() - t0) / 1e9;
  const c = process.cpuUsage(c0);
  bestBatch = Math.min(bestBatch, s);
  bestBatchCpu = Math.min(bestBatchCpu, (c.user + c.system) / 1e6);
}
let mismatches = 0;
all.forEach((ids, i) => {
  if (ids.join(',') !== ours[i]) ++mismatches;
});
console.log(`HF tokenizers 0.23.2 (Node binding) encode, one call at a time: ${(bytes / 1e6 / bestCpu).toFixed(1)} MB/s per CPU second, ${(bytes / 1e6 / best).toFixed(1)} MB/s wall (best of 3)`);
console.log(`HF tokenizers 0.23.2 (Node binding) encodeBatch x256, TOKENIZERS_PARALLELISM=${process.env.TOKENIZERS_PARALLELISM}: ${(bytes / 1e6 / bestBatchCpu).toFixed(1)} MB/s per CPU second, ${(bytes / 1e6 / bestBatch).toFixed(1)} MB/s wall (best of 3)`);
console.log(`ids identical to dsv4 on ${docs.length - mismatches}/${docs.length} documents`);
process.exit(mismatches === 0 ? 0 : 1);
