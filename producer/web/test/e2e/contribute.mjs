// Contribute from the demo page in headless Chromium, as a person and then as many devices.
//
//   node test/e2e/contribute.mjs PAGE_URL K SCREENSHOT_PATH [EXAMPLES_JSON [SECOND_JSON]]
//
// Opens PAGE_URL (the demo page with ?study=…&key=…), waits for the study to verify, types the
// first example into the form, prepares and contributes it with the page's own buttons, then
// sends K − 1 more through window.ipdpContributeMany. An example is {x, y}, or {row: {column:
// value}} for a study with a schema: the row is typed into the page's named fields. Prints one
// JSON object on stdout: what the page displayed, what ipdpContributeMany returned, the body of
// every POST the browser made (hex), captured from the network, and every answer of 400 or more.
// Exits 1 (with the JSON, `error` set) if a step fails.
//
// SECOND_JSON, {"url", "k", "screenshot", "examples"}, does the same on a second page in the same
// browser (another study, e.g. a two-server one) once the first is done; its own JSON object is
// the output's `second`.
//
// The browser is Debian's chromium driven by playwright-core (no browser is downloaded):
// IPDP_CHROMIUM overrides its path.
import { writeFileSync } from "node:fs";
import { chromium } from "playwright-core";

const [url, kText, screenshot, examplesJson, secondJson] = process.argv.slice(2);
const k = Number(kText);
if (!url || !Number.isInteger(k) || k < 1 || !screenshot) {
  console.error("usage: contribute.mjs PAGE_URL K SCREENSHOT_PATH [EXAMPLES_JSON [SECOND_JSON]]");
  process.exit(2);
}
const examples = examplesJson ? JSON.parse(examplesJson) : [{ x: [0.5, -0.25, 0.125], y: 0.3 }];
const second = secondJson ? JSON.parse(secondJson) : null;

const browser = await chromium.launch({
  executablePath: process.env.IPDP_CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
});

/** The steps at the top on one page: what it showed and sent, `error` set if a step failed. */
async function contributeOnPage(url, k, screenshot, examples) {
  const out = { posts: [], console: [], pageErrors: [], failedResponses: [] };
  try {
    const page = await browser.newPage({ viewport: { width: 1000, height: 900 } });
    page.on("console", (m) => out.console.push(`${m.type()}: ${m.text()}`));
    page.on("pageerror", (e) => out.pageErrors.push(String(e)));
    page.on("response", (r) => {
      if (r.status() >= 400) out.failedResponses.push(`${r.status()} ${r.request().method()} ${r.url()}`);
    });
    page.on("request", (r) => {
      if (r.method() === "POST" && r.url().includes("/records")) {
        out.posts.push({ url: r.url(), contentType: r.headers()["content-type"],
          body: (r.postDataBuffer() ?? Buffer.alloc(0)).toString("hex") });
      }
    });

    await page.goto(url);
    await page.evaluate(() => window.ipdpReady);
    out.studyStatus = await page.textContent("#study-status");
    out.report = await page.$$eval("#report-list li", (items) => items.map((li) => li.textContent));
    if (!(await page.isVisible("#example-section"))) throw new Error(`study not loaded: ${out.studyStatus}`);

    // One record the way a person sends it: type, prepare, look, contribute.
    const first = examples[0];
    if (first.row) {
      out.fields = await page.$$eval("#row-fields label", (labels) => labels.map((l) => l.textContent));
      for (const [column, value] of Object.entries(first.row)) {
        const selector = `[data-column="${column}"]`;
        if ((await page.$eval(selector, (el) => el.tagName)) === "SELECT") {
          await page.selectOption(selector, String(value));
        } else {
          await page.fill(selector, String(value));
        }
      }
    } else {
      await page.fill("#x", first.x.join(", "));
      await page.fill("#y", String(first.y));
    }
    await page.click("#example-form button[type=submit]");
    await page.waitForSelector("#record-section:not([hidden])");
    out.exampleStatus = await page.textContent("#example-status");
    const shown = async () => ({
      recordId: await page.textContent("#record-id"),
      q: await page.textContent("#record-q"),
      p: await page.textContent("#record-p"),
      hex: await page.textContent("#record-hex"),
    });
    out.prepared = await shown();
    await page.click("#send");
    await page.waitForFunction(() => document.querySelector("#send-status")?.className !== "" &&
      !document.querySelector("#send-status")?.textContent?.startsWith("Sending"));
    out.sendStatus = await page.textContent("#send-status");
    if (!out.sendStatus.startsWith("Accepted")) throw new Error(`not accepted: ${out.sendStatus}`);

    // The other k − 1 as simulated devices, through the page's test hook.
    out.many = k > 1
      ? await page.evaluate(([n, ex]) => window.ipdpContributeMany(n, ex[0].row
        ? { rows: ex.map((e) => e.row) } : { examples: ex }), [k - 1, examples])
      : { recordIds: [], records: [], q: [], p: [], accepted: 0 };
    out.displayed = await shown();
    out.finalStatus = await page.textContent("#send-status");
    await page.screenshot({ path: screenshot, fullPage: true });
  } catch (error) {
    out.error = String(error?.stack ?? error);
  }
  return out;
}

let out;
try {
  out = await contributeOnPage(url, k, screenshot, examples);
  if (second !== null && !out.error) {
    out.second = await contributeOnPage(second.url, second.k, second.screenshot,
      second.examples ?? examples);
  }
} finally {
  await browser.close();
}
const failed = out.error ?? out.second?.error;
writeFileSync(1, JSON.stringify(out) + "\n");
process.exit(failed ? 1 : 0);
