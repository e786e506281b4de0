// SPDX-License-Identifier: MIT
// Starts `dsv4 serve` on a free port of 127.0.0.1 for a test or benchmark, and makes sure it never outlives us.
//   DSV4_BINARY: the dsv4 executable (default: build/src/dsv4), DSV4_MODEL: model dir (default: models/tiny).
import { spawn } from "node:child_process";
import path from "node:path";
import { fileURLToPath } from "node:url";

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../..");
export const binary = process.env.DSV4_BINARY ?? path.join(root, "build/src/dsv4");
export const modelDir = process.env.DSV4_MODEL ?? path.join(root, "models/tiny");
export const modelName = path.basename(modelDir);

const running = new Set();
process.on("exit", () => {
  for (const child of running) child.kill("SIGKILL");
});

// Resolves once the server prints its "listening on http://HOST:PORT" line.
export function startServer(extraArgs = [], { startTimeoutMs = 20000 } = {}) {
  const child = spawn(binary, ["serve", "--model", modelDir, "--port", "0", ...extraArgs], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  running.add(child);
  let log = "";
  const exited = new Promise((resolve) => {
    child.on("exit", (code, signal) => {
      running.delete(child);
      resolve({ code, signal });
    });
  });
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`dsv4 serve did not start within ${startTimeoutMs} ms:\n${log}`));
    }, startTimeoutMs);
    const onData = (chunk) => {
      log += chunk;
      const m = /listening on (http:\/\/[\d.]+:(\d+))/.exec(log);
      if (m && timer) {
        clearTimeout(timer);
        resolve({
          url: m[1],
          port: Number(m[2]),
          child,
          exited,
          log: () => log,
          // SIGTERM, then SIGKILL if it has not exited within graceMs; resolves to {code, signal}.
          async stop(graceMs = 10000) {
            if (child.exitCode !== null || child.signalCode !== null) return exited;
            child.kill("SIGTERM");
            const kill = setTimeout(() => child.kill("SIGKILL"), graceMs);
            const result = await exited;
            clearTimeout(kill);
            return result;
          },
        });
      }
    };
    child.stdout.on("data", onData);
    child.stderr.on("data", onData);
    child.on("exit", (code) => reject(new Error(`dsv4 serve exited (${code}) before listening:\n${log}`)));
  });
}

// The value of the metric line `name value` in a /metrics text; name includes any labels: `x{reason="stop"}`.
export function metricValue(text, name) {
  const line = text.split("\n").find((l) => l.startsWith(name + " "));
  return line === undefined ? undefined : Number(line.slice(name.length + 1));
}

export async function metrics(url) {
  return (await fetch(`${url}/metrics`)).text();
}

// Polls until predicate(metrics text) holds or the timeout passes; returns the last text.
export async function waitForMetrics(url, predicate, timeoutMs = 10000) {
  const deadline = Date.now() + timeoutMs;
  let text = "";
  while (Date.now() < deadline) {
    text = await metrics(url);
    if (predicate(text)) return text;
    await new Promise((r) => setTimeout(r, 50));
  }
  return text;
}
