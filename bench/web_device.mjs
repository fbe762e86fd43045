// The browser SDK's device step, one record at a time, d = 14: prepareRecord (one-server) and
// prepareTwoServerRecord (two-server: perturb, fixed point, shares, HPKE seal) on the signed
// studies of producer/web/test-vectors.json. bench/two_server.py runs it.
//
//   node bench/web_device.mjs RECORDS            # under Node (V8 and WebCrypto, not a browser)
//   node bench/web_device.mjs RECORDS --browser  # in headless Chromium (playwright-core)
//
// Prints one JSON object: per mode, records, CPU seconds and wall seconds of the loop, and bytes
// per record. Under Node the CPU is this process's (process.cpuUsage: every thread, WebCrypto's
// included); in Chromium it is the CPU of the browser's processes (/proc) over the loop, which
// runs in the page. Needs producer/web built (npm ci && npm run build there); the browser is
// Debian's chromium unless IPDP_CHROMIUM names another.
import { readFileSync, readdirSync } from "node:fs";
import { createServer } from "node:http";
import { createRequire } from "node:module";
import { execFileSync } from "node:child_process";

const records = Number(process.argv[2] ?? "200");
const inBrowser = process.argv.includes("--browser");
if (!Number.isInteger(records) || records < 1) {
  console.error("usage: web_device.mjs RECORDS [--browser]");
  process.exit(2);
}
const web = new URL("../producer/web/", import.meta.url);
const vectors = JSON.parse(readFileSync(new URL("test-vectors.json", web), "utf8"));
const setup = {
  records,
  owner: vectors.keys.owner_public_key,
  envelopes: { "one-server": vectors.studies[0].envelope, "two-server": vectors.two_server.envelope },
};

/** Runs in Node or in the page: imports the SDK from `base`, times each mode's loop. */
async function measure(base, setup, cpuNow) {
  const sdk = await import(`${base}index.js`);
  const twoServer = await import(`${base}two-server.js`);
  const owner = await sdk.importTrustedKey(setup.owner);
  const out = {};
  for (const [mode, envelope] of Object.entries(setup.envelopes)) {
    const verified = await sdk.verifyStudyEnvelope(envelope, [owner]);
    const d = verified.study.d;
    const prepare = mode === "one-server" ? async (x, y) => sdk.prepareRecord(verified, x, y)
      : (x, y) => twoServer.prepareTwoServerRecord(verified, x, y);
    const examples = Array.from({ length: setup.records }, () => {
      const x = Array.from({ length: d }, () => (Math.random() - 0.5) / Math.sqrt(d));
      return { x, y: Math.max(-1, Math.min(1, x.reduce((a, b) => a + b, 0))) };
    });
    for (const { x, y } of examples.slice(0, 50)) await prepare(x, y); // warm-up: the JIT
    const sizes = new Set();
    const cpu = await cpuNow();
    const started = performance.now();
    for (const { x, y } of examples) sizes.add((await prepare(x, y)).bytes.length);
    const wall = (performance.now() - started) / 1000;
    out[mode] = { d, records: setup.records, cpu_s: (await cpuNow()) - cpu, wall_s: wall,
      bytes_per_record: [...sizes] };
  }
  return out;
}

/** CPU seconds of this process alone, in /proc's clock ticks (as treeCpu counts it). */
function ownCpu(tick) {
  const fields = readFileSync(`/proc/${process.pid}/stat`, "utf8").split(") ")[1].split(" ");
  return (Number(fields[11]) + Number(fields[12])) / tick;
}

/** CPU seconds of process `pid`, its threads and its live descendants (/proc). */
function treeCpu(pid, tick) {
  let total = 0;
  try {
    const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].split(" ");
    total = (Number(fields[11]) + Number(fields[12])) / tick;
    for (const task of readdirSync(`/proc/${pid}/task`)) {
      const children = readFileSync(`/proc/${pid}/task/${task}/children`, "utf8").trim();
      for (const child of children ? children.split(" ") : []) total += treeCpu(child, tick);
    }
  } catch {
    // the process ended between the listing and the read
  }
  return total;
}

let out;
if (!inBrowser) {
  const dist = new URL("dist/src/", web).href;
  out = await measure(dist, setup, async () => {
    const u = process.cpuUsage();
    return (u.user + u.system) / 1e6;
  });
} else {
  const { chromium } = createRequire(new URL("package.json", web))("playwright-core");
  const dist = new URL("dist/src/", web);
  const server = createServer((req, res) => {
    try {
      const body = readFileSync(new URL(`.${new URL(req.url, "http://x").pathname}`, dist));
      res.writeHead(200, { "content-type": "text/javascript" }).end(body);
    } catch {
      res.writeHead(404).end();
    }
  });
  await new Promise((ok) => server.listen(0, "127.0.0.1", ok));
  const exe = process.env.IPDP_CHROMIUM || "/usr/bin/chromium";
  const browser = await chromium.launch({ executablePath: exe, headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking"] });
  try {
    const page = await browser.newPage();
    const base = `http://127.0.0.1:${server.address().port}/`;
    await page.goto(`${base}index.js`); // a secure context (loopback) for WebCrypto
    const tick = Number(execFileSync("getconf", ["CLK_TCK"], { encoding: "utf8" }));
    // Chromium runs as this process's child (playwright's driver is in process): the CPU of
    // every descendant is the browser's.
    await page.exposeFunction("cpuNow", () => treeCpu(process.pid, tick) - ownCpu(tick));
    out = await page.evaluate(
      `(${measure.toString()})(${JSON.stringify(base)}, ${JSON.stringify(setup)}, window.cpuNow)`);
  } finally {
    await browser.close();
    server.close();
  }
}
console.log(JSON.stringify(out));
