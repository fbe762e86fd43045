// The browser SDK's device step, timed under Node (the same V8 engine and WebCrypto API as
// Chromium, not a browser): prepareRecord (one-server) and prepareTwoServerRecord (two-server:
// perturb, fixed point, shares, HPKE seal) for one record at a time, d = 14, on the signed
// studies of producer/web/test-vectors.json. bench/two_server.py runs it.
//
//   node bench/web_device.mjs RECORDS
//
// Prints one JSON object: per mode, records, CPU seconds of this process (process.cpuUsage:
// every thread, WebCrypto's included), wall seconds and bytes per record. Needs producer/web
// built (npm ci && npm run build there).
import { readFileSync } from "node:fs";

const records = Number(process.argv[2] ?? "200");
if (!Number.isInteger(records) || records < 1) {
  console.error("usage: web_device.mjs RECORDS");
  process.exit(2);
}
const web = new URL("../producer/web/", import.meta.url);
const sdk = await import(new URL("dist/src/index.js", web).href);
const twoServer = await import(new URL("dist/src/two-server.js", web).href);
const vectors = JSON.parse(readFileSync(new URL("test-vectors.json", web), "utf8"));
const owner = await sdk.importTrustedKey(vectors.keys.owner_public_key);
const studies = {
  "one-server": await sdk.verifyStudyEnvelope(vectors.studies[0].envelope, [owner]),
  "two-server": await sdk.verifyStudyEnvelope(vectors.two_server.envelope, [owner]),
};

function example(d) {
  const x = Array.from({ length: d }, () => (Math.random() - 0.5) / Math.sqrt(d));
  return { x, y: Math.max(-1, Math.min(1, x.reduce((a, b) => a + b, 0))) };
}

async function prepare(mode, verified, x, y) {
  return mode === "one-server" ? sdk.prepareRecord(verified, x, y)
    : twoServer.prepareTwoServerRecord(verified, x, y);
}

const out = {};
for (const [mode, verified] of Object.entries(studies)) {
  const d = verified.study.d;
  const examples = Array.from({ length: records }, () => example(d));
  for (let i = 0; i < Math.min(records, 50); i++) {
    await prepare(mode, verified, examples[i].x, examples[i].y); // warm-up: the JIT
  }
  const sizes = new Set();
  const cpu = process.cpuUsage();
  const started = performance.now();
  for (const { x, y } of examples) sizes.add((await prepare(mode, verified, x, y)).bytes.length);
  const wall = (performance.now() - started) / 1000;
  const used = process.cpuUsage(cpu);
  out[mode] = { d, records, cpu_s: (used.user + used.system) / 1e6, wall_s: wall,
    bytes_per_record: [...sizes] };
}
console.log(JSON.stringify(out));
