// SPDX-License-Identifier: MIT
// `dsv4 serve` driven by OpenAI's official Node client over real HTTP on 127.0.0.1, with the embedded tiny
// model: models, chat and text completions (plain and streamed), usage, logprobs, stop, seeds, 32 concurrent
// requests equal to the same requests alone, cancellation frees the slot, bad input, overload, SIGTERM drain.
// Run: node --test tools/server-tests/ (CTest: server.openai_node).
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";
import OpenAI from "openai";

import { metrics, metricValue, modelName, startServer, waitForMetrics } from "./server.mjs";

const client = (url, options = {}) =>
  new OpenAI({ baseURL: `${url}/v1`, apiKey: "unused", maxRetries: 0, timeout: 30000, ...options });

const greedy = { model: modelName, temperature: 0 };
const PROMPTS = Array.from({ length: 32 }, (_, i) => `Request ${i}: ${"abcdefghij".slice(0, 1 + (i % 10))} ${i * 7}`);

async function collectChatStream(stream) {
  let text = "";
  let finish = null;
  let usage = null;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      text += choice.delta?.content ?? "";
      finish = choice.finish_reason ?? finish;
    }
  }
  return { text, finish, usage, chunks };
}

describe("dsv4 serve with the OpenAI client", { timeout: 90000 }, () => {
  let server;
  let openai;
  before(async () => {
    server = await startServer(["--max-batch", "8", "--max-queue", "64", "--max-context", "1024"]);
    openai = client(server.url);
  });
  after(async () => {
    const { code } = await server.stop();
    assert.equal(code, 0, "server exits 0 on SIGTERM");
  });

  test("models lists the served model", async () => {
    const list = await openai.models.list();
    assert.deepEqual(list.data.map((m) => m.id), [modelName]);
    const model = await openai.models.retrieve(modelName);
    assert.equal(model.id, modelName);
  });

  test("chat completion: message, finish reason, usage", async () => {
    const r = await openai.chat.completions.create({ ...greedy, messages: [{ role: "user", content: "Hello" }], max_tokens: 12 });
    assert.equal(r.object, "chat.completion");
    assert.equal(r.choices.length, 1);
    assert.equal(r.choices[0].message.role, "assistant");
    assert.equal(typeof r.choices[0].message.content, "string");
    assert.ok(["length", "stop"].includes(r.choices[0].finish_reason));
    assert.equal(r.usage.prompt_tokens, 7); // BOS <｜User｜> Hel lo <｜Assistant｜> </think>... as tokenised
    assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 12);
    assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  });

  test("streamed chat equals the non-streamed answer and reports usage", async () => {
    const request = { ...greedy, messages: [{ role: "system", content: "Be brief." }, { role: "user", content: "Hi there" }], max_tokens: 20 };
    const whole = await openai.chat.completions.create(request);
    const streamed = await collectChatStream(
      await openai.chat.completions.create({ ...request, stream: true, stream_options: { include_usage: true } }),
    );
    assert.equal(streamed.text, whole.choices[0].message.content);
    assert.equal(streamed.finish, whole.choices[0].finish_reason);
    assert.deepEqual(streamed.usage, whole.usage);
    assert.ok(streamed.chunks >= 3, "role chunk, content chunks, finish chunk");
  });

  test("text completion with logprobs, streamed and not", async () => {
    const request = { ...greedy, prompt: "The quick brown fox", max_tokens: 6, logprobs: 3 };
    const whole = await openai.completions.create(request);
    const lp = whole.choices[0].logprobs;
    assert.equal(lp.tokens.length, 6);
    assert.equal(lp.token_logprobs.length, 6);
    for (let i = 0; i < 6; i++) {
      assert.ok(lp.token_logprobs[i] <= 0);
      const top = Object.values(lp.top_logprobs[i]);
      assert.ok(top.length >= 1 && top.length <= 4); // tokens whose text is the same (U+FFFD) share a key
      assert.equal(Math.max(...top), lp.token_logprobs[i], "greedy picks the most likely token");
    }
    let text = "";
    const tokens = [];
    for await (const chunk of await openai.completions.create({ ...request, stream: true })) {
      text += chunk.choices[0]?.text ?? "";
      tokens.push(...(chunk.choices[0]?.logprobs?.tokens ?? []));
    }
    assert.equal(text, whole.choices[0].text);
    assert.deepEqual(tokens, lp.tokens);
  });

  test("chat logprobs with top_logprobs", async () => {
    const r = await openai.chat.completions.create({
      ...greedy, messages: [{ role: "user", content: "x" }], max_tokens: 4, logprobs: true, top_logprobs: 2,
    });
    const content = r.choices[0].logprobs.content;
    assert.equal(content.length, r.usage.completion_tokens);
    for (const t of content) {
      assert.equal(t.top_logprobs.length, 2);
      assert.equal(t.top_logprobs[0].logprob, t.logprob);
      assert.deepEqual(Buffer.from(t.bytes).toString("utf8").length > 0 || t.bytes.length === 0, true);
    }
  });

  test("stop sequences cut the output before them", async () => {
    const base = { ...greedy, prompt: "Once upon a time", max_tokens: 30 };
    const full = (await openai.completions.create(base)).choices[0].text;
    assert.ok(full.length > 10);
    const stop = full.slice(Math.floor(full.length / 2), Math.floor(full.length / 2) + 3);
    const cut = await openai.completions.create({ ...base, stop: [stop, "\u0001never"] });
    assert.equal(cut.choices[0].text, full.slice(0, full.indexOf(stop)));
    assert.equal(cut.choices[0].finish_reason, "stop");
  });

  test("seeded sampling repeats, another seed differs", async () => {
    const base = { model: modelName, prompt: "Hello", max_tokens: 24, temperature: 1.0, top_p: 0.95 };
    const [a, b, c] = await Promise.all([
      openai.completions.create({ ...base, seed: 7 }),
      openai.completions.create({ ...base, seed: 7 }),
      openai.completions.create({ ...base, seed: 8 }),
    ]);
    assert.equal(a.choices[0].text, b.choices[0].text);
    assert.notEqual(a.choices[0].text, c.choices[0].text);
  });

  test("32 concurrent greedy requests each get exactly what they get alone", async () => {
    const request = (i, stream) => ({
      ...greedy, messages: [{ role: "user", content: PROMPTS[i] }], max_tokens: 8 + (i % 5) * 4, stream,
    });
    const alone = [];
    for (let i = 0; i < PROMPTS.length; i++)
      alone.push((await openai.chat.completions.create(request(i, false))).choices[0].message.content);
    const t0 = Date.now();
    const together = await Promise.all(
      PROMPTS.map(async (_, i) =>
        i % 2
          ? (await collectChatStream(await openai.chat.completions.create(request(i, true)))).text
          : (await openai.chat.completions.create(request(i, false))).choices[0].message.content,
      ),
    );
    const seconds = (Date.now() - t0) / 1000;
    assert.deepEqual(together, alone);
    const m = await metrics(server.url);
    assert.ok(metricValue(m, "dsv4_engine_steps_total") > 0);
    console.log(`# 32 concurrent requests in ${seconds.toFixed(2)} s`);
  });

  test("aborting a stream frees its slot", async () => {
    const before = metricValue(await metrics(server.url), 'dsv4_requests_finished_total{reason="cancelled"}');
    const controller = new AbortController();
    const stream = await openai.chat.completions.create(
      { ...greedy, messages: [{ role: "user", content: "Tell me everything" }], max_tokens: 900, stream: true, ignore_eos: true },
      { signal: controller.signal },
    );
    let chunks = 0;
    try {
      for await (const _ of stream) {
        if (++chunks === 3) {
          controller.abort(); // closes the connection mid-stream
          break;
        }
      }
    } catch (e) {
      assert.ok(e instanceof OpenAI.APIUserAbortError || e.name === "AbortError", String(e));
    }
    assert.equal(chunks, 3, "the stream stopped at the abort");
    const m = await waitForMetrics(
      server.url,
      (t) => metricValue(t, "dsv4_running_sequences") === 0 &&
        metricValue(t, 'dsv4_requests_finished_total{reason="cancelled"}') === before + 1,
    );
    assert.equal(metricValue(m, "dsv4_running_sequences"), 0);
    assert.equal(metricValue(m, 'dsv4_requests_finished_total{reason="cancelled"}'), before + 1);
    // The server keeps serving.
    const r = await openai.completions.create({ ...greedy, prompt: "ok", max_tokens: 2 });
    assert.equal(r.usage.completion_tokens, 2);
  });

  test("bad requests get OpenAI errors with 4xx status", async () => {
    const cases = [
      [{ ...greedy, messages: [] }, 400, "messages"],
      [{ ...greedy, messages: [{ role: "wizard", content: "x" }] }, 400, "messages[0].role"],
      [{ ...greedy, messages: [{ role: "user", content: "x" }], temperature: -1 }, 400, "temperature"],
      [{ ...greedy, messages: [{ role: "user", content: "x" }], max_tokens: -3 }, 400, "max_tokens"],
      [{ ...greedy, messages: [{ role: "user", content: "x" }], max_tokens: 10 ** 12 }, 400, "max_tokens"],
      [{ ...greedy, messages: [{ role: "user", content: "x" }], n: 3 }, 400, "n"],
      [{ ...greedy, messages: [{ role: "user", content: "x" }], top_p: 7 }, 400, "top_p"],
      [{ ...greedy, messages: [{ role: "user", content: "x" }], surprise: true }, 400, "surprise"],
      [{ ...greedy, messages: [{ role: "user", content: "word ".repeat(2000) }] }, 400, "messages"],
      [{ ...greedy, model: "gpt-4o", messages: [{ role: "user", content: "x" }] }, 404, "model"],
    ];
    for (const [body, status, param] of cases) {
      await assert.rejects(openai.chat.completions.create(body), (e) => {
        assert.ok(e instanceof OpenAI.APIError, String(e));
        assert.equal(e.status, status, JSON.stringify(body).slice(0, 120));
        assert.equal(e.param, param);
        assert.equal(typeof e.message, "string");
        return true;
      });
    }
    const long = await openai.chat.completions
      .create({ ...greedy, messages: [{ role: "user", content: "word ".repeat(2000) }] })
      .catch((e) => e);
    assert.equal(long.code, "context_length_exceeded");
  });
});

describe("overload and shutdown", { timeout: 60000 }, () => {
  test("a full queue answers 429 with Retry-After", async () => {
    const server = await startServer(["--max-batch", "1", "--max-queue", "1"]);
    try {
      const body = (n) => JSON.stringify({ ...greedy, prompt: "busy", max_tokens: n, ignore_eos: true, stream: true });
      const post = (n) => fetch(`${server.url}/v1/completions`, { method: "POST", body: body(n) });
      const running = await post(4000); // its headers come with the first token
      const queued = post(4000); // waits for the slot: no headers yet
      await waitForMetrics(server.url, (t) => metricValue(t, "dsv4_queue_length") === 1);
      const refused = await fetch(`${server.url}/v1/completions`, { method: "POST", body: JSON.stringify({ ...greedy, prompt: "x", max_tokens: 1 }) });
      assert.equal(refused.status, 429);
      assert.equal(refused.headers.get("retry-after"), "1");
      assert.equal((await refused.json()).error.type, "rate_limit_error");
      await running.body.cancel();
      await (await queued).body.cancel();
      await waitForMetrics(server.url, (t) => metricValue(t, "dsv4_running_sequences") === 0 && metricValue(t, "dsv4_queue_length") === 0);
      const ok = await fetch(`${server.url}/v1/completions`, { method: "POST", body: JSON.stringify({ ...greedy, prompt: "x", max_tokens: 1 }) });
      assert.equal(ok.status, 200);
    } finally {
      await server.stop();
    }
  });

  test("SIGTERM drains running streams, refuses new requests, exits 0", async () => {
    const server = await startServer(["--max-batch", "2"]);
    const openai = client(server.url);
    const stream = await openai.chat.completions.create({
      ...greedy, messages: [{ role: "user", content: "long answer" }], max_tokens: 300, ignore_eos: true, stream: true,
      stream_options: { include_usage: true },
    });
    const reading = collectChatStream(stream);
    await new Promise((r) => setTimeout(r, 100));
    server.child.kill("SIGTERM");
    await new Promise((r) => setTimeout(r, 100));
    const late = await fetch(`${server.url}/v1/completions`, { method: "POST", body: JSON.stringify({ ...greedy, prompt: "x" }) })
      .then((r) => r.status)
      .catch(() => "refused");
    assert.ok(late === 503 || late === "refused", `request during drain: ${late}`);
    const result = await reading;
    assert.equal(result.usage.completion_tokens, 300, "the running stream was completed");
    assert.equal(result.finish, "length");
    const { code } = await server.exited;
    assert.equal(code, 0);
  });

  test("past --drain-timeout, SIGTERM cancels what is left and still exits 0", async () => {
    const server = await startServer(["--drain-timeout", "0.2"]);
    const openai = client(server.url);
    const stream = await openai.completions.create({
      ...greedy, prompt: "endless", max_tokens: 4000, ignore_eos: true, stream: true,
    });
    const reading = (async () => {
      let chunks = 0;
      try {
        for await (const _ of stream) chunks++;
      } catch (e) {
        return { chunks, error: e };
      }
      return { chunks, error: null };
    })();
    await new Promise((r) => setTimeout(r, 100));
    const t0 = Date.now();
    server.child.kill("SIGTERM");
    const { chunks, error } = await reading;
    assert.ok(chunks > 0 && chunks < 4000, `chunks before the cut: ${chunks}`);
    assert.ok(error instanceof OpenAI.APIError, `the stream ends with an error event: ${error}`);
    const { code } = await server.exited;
    assert.equal(code, 0);
    assert.ok(Date.now() - t0 < 8000, "exits soon after the drain timeout");
  });
});
