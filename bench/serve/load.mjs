// SPDX-License-Identifier: MIT
// Load benchmark for `dsv4 serve` (not a test): C concurrent clients, each sending streamed completions back to
// back, for C in 1, 8, 32, 64. Measures request and token throughput, time to first token, inter-token latency
// and end-to-end latency percentiles from the client side (SSE arrival times), and prints a markdown table.
//
//   node bench/serve/load.mjs [--url http://127.0.0.1:8000] [--model NAME] [--concurrency 1,8,32,64]
//                             [--requests-per-client 4] [--prompt-words 32] [--max-tokens 64] [--max-batch 64]
//                             [--threads 1]
// Without --url it starts `dsv4 serve` itself (DSV4_BINARY, DSV4_MODEL as in tools/server-tests/server.mjs).
import os from "node:os";
import { parseArgs } from "node:util";

import { modelName, startServer } from "../../tools/server-tests/server.mjs";

const { values: opt } = parseArgs({
  options: {
    url: { type: "string" },
    model: { type: "string" },
    concurrency: { type: "string", default: "1,8,32,64" },
    "requests-per-client": { type: "string", default: "4" },
    "prompt-words": { type: "string", default: "32" },
    "max-tokens": { type: "string", default: "64" },
    "max-batch": { type: "string", default: "64" },
    threads: { type: "string", default: "1" }, // engine threads of the server it starts (1 suits the tiny model)
  },
});
const levels = opt.concurrency.split(",").map(Number);
const perClient = Number(opt["requests-per-client"]);
const maxTokens = Number(opt["max-tokens"]);
const words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split(" ");

function percentile(sorted, p) {
  if (!sorted.length) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

// One streamed completion; returns client-side timings in seconds.
async function streamOnce(url, model, client, k) {
  const prompt = Array.from({ length: Number(opt["prompt-words"]) }, (_, i) => words[(i * 7 + client * 3 + k) % words.length]).join(" ");
  const t0 = performance.now();
  const res = await fetch(`${url}/v1/completions`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true, stream: true,
                           stream_options: { include_usage: true } }),
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const arrivals = []; // one per content chunk (= one token, or a few when the client lags)
  let tokens = 0;
  let buffer = "";
  const decoder = new TextDecoder();
  for await (const bytes of res.body) {
    buffer += decoder.decode(bytes, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      if (chunk.choices?.length && chunk.choices[0].finish_reason === null) arrivals.push(performance.now());
    }
  }
  const t1 = performance.now();
  const itl = arrivals.slice(1).map((t, i) => (t - arrivals[i]) / 1000);
  return { ttft: (arrivals[0] - t0) / 1000, itl, e2e: (t1 - t0) / 1000, tokens };
}

async function runLevel(url, model, concurrency) {
  const results = [];
  const t0 = performance.now();
  await Promise.all(
    Array.from({ length: concurrency }, async (_, client) => {
      for (let k = 0; k < perClient; k++) results.push(await streamOnce(url, model, client, k));
    }),
  );
  const seconds = (performance.now() - t0) / 1000;
  const sortedBy = (f) => results.flatMap(f).sort((a, b) => a - b);
  const ttft = sortedBy((r) => [r.ttft]);
  const itl = sortedBy((r) => r.itl);
  const e2e = sortedBy((r) => [r.e2e]);
  const tokens = results.reduce((s, r) => s + r.tokens, 0);
  return { concurrency, requests: results.length, seconds, reqPerS: results.length / seconds, tokPerS: tokens / seconds,
           ttft, itl, e2e };
}

const ms = (s) => (s * 1000).toFixed(1);
let server = null;
let url = opt.url;
let model = opt.model ?? modelName;
if (!url) {
  server = await startServer(["--max-batch", opt["max-batch"], "--max-queue", "256", "--max-context", "1024",
                              "--threads", opt.threads]);
  url = server.url;
}
try {
  await streamOnce(url, model, 0, 0); // warm-up
  console.log(`dsv4 serve load benchmark: ${os.cpus().length} CPUs (${os.cpus()[0].model}), model ${model}, ` +
              `prompt ${opt["prompt-words"]} words, ${maxTokens} tokens per request (ignore_eos), ` +
              `${perClient} requests per client, --max-batch ${opt["max-batch"]}` +
              (server ? `, --threads ${opt.threads}` : "") + `, load average ${os.loadavg()[0].toFixed(1)}\n`);
  console.log("| clients | requests | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | latency p50 / p99 (s) |");
  console.log("|---|---|---|---|---|---|---|");
  for (const c of levels) {
    const r = await runLevel(url, model, c);
    console.log(`| ${c} | ${r.requests} | ${r.reqPerS.toFixed(2)} | ${r.tokPerS.toFixed(0)} | ` +
                `${ms(percentile(r.ttft, 50))} / ${ms(percentile(r.ttft, 90))} / ${ms(percentile(r.ttft, 99))} | ` +
                `${ms(percentile(r.itl, 50))} / ${ms(percentile(r.itl, 90))} / ${ms(percentile(r.itl, 99))} | ` +
                `${percentile(r.e2e, 50).toFixed(2)} / ${percentile(r.e2e, 99).toFixed(2)} |`);
  }
} finally {
  if (server) await server.stop();
}
