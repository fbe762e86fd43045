/**
 * The demo page: verify a study, perturb one typed example on the device, show the record that
 * would leave it, and send it on request. `window.ipdpContributeMany(k)` lets an automated test
 * contribute k records from the page.
 *
 * A study with a schema gets one field per named column, each showing its public range; the
 * page encodes the typed row through the schema (src/schema.ts) and says which values it clipped.
 * A two-server study gets version-3 records (src/two-server.ts, loaded only for one): the
 * leader's share and the helper's sealed share of what the page shows.
 *
 * Query parameters (all optional): gateway (default: this page's origin), study, key.
 */

import {
  encodeRow, fetchStudy, IpdpError, prepareRecord, privacyReport, sendRecord, toHex,
  type PreparedRecord, type RawRow, type Schema, type VerifiedStudy,
} from "../src/index.js";

interface Example {
  readonly x: readonly number[];
  readonly y: number;
  /** Columns whose typed value was clipped to its range (a study with a schema). */
  readonly clipped?: readonly string[];
}

interface ManyResult {
  readonly recordIds: string[];
  /** The bytes of each record sent, hex. */
  readonly records: string[];
  readonly q: number[][];
  readonly p: number[][];
  readonly accepted: number;
}

interface ManyOptions {
  /** Examples to perturb, cycled; the example typed in the form when absent. */
  readonly examples?: readonly Example[];
  /** Raw rows (column name → value) to encode through the study's schema, instead. */
  readonly rows?: readonly RawRow[];
  /** Requests in flight at once, each one record (every simulated device sends its own); 6 by
   * default, a browser's connections per host over HTTP/1.1. */
  readonly concurrency?: number;
}

declare global {
  interface Window {
    ipdpContributeMany: (k: number, options?: ManyOptions) => Promise<ManyResult>;
    /** Resolves once the page is wired up and any study named in the URL is loaded. */
    ipdpReady: Promise<void>;
  }
}

const $ = <T extends HTMLElement>(id: string) => document.getElementById(id) as T;
const input = (id: string) => $<HTMLInputElement>(id);

let verified: VerifiedStudy | null = null;
let prepared: PreparedRecord | null = null;

function say(id: string, text: string, kind: "ok" | "error" | "" = "") {
  const el = $(id);
  el.textContent = text;
  el.className = kind;
}

function explain(error: unknown): string {
  if (error instanceof IpdpError) {
    const what: Record<string, string> = {
      unknown_study: "The gateway does not know this study.",
      closed_study: "This study is closed and accepts no more records.",
      bad_signature: "The study is not signed by the key you pinned. Nothing was sent.",
      bad_key: "The public key is not valid.",
      bad_study: "The study is not in a form this page understands.",
      wrong_dimension: "The example does not have the study's number of features.",
      invalid_example: "The example is not valid.",
      unsupported_runtime: "This browser lacks what the page needs.",
      gateway_refused: "The gateway refused the record.",
      gateway_unreachable: "The gateway could not be reached.",
    };
    return `${what[error.reason] ?? ""} (${error.reason}: ${error.detail})`;
  }
  return String(error);
}

function gatewayUrl(): string {
  return input("gateway").value.trim() || location.origin;
}

async function loadStudy(): Promise<VerifiedStudy> {
  verified = null;
  prepared = null;
  $("report").hidden = $("example-section").hidden = $("record-section").hidden = true;
  say("study-status", "Fetching and verifying the study…");
  const study = await fetchStudy(gatewayUrl(), input("study").value.trim(), input("key").value);
  verified = study;
  const list = $("report-list");
  list.replaceChildren(...privacyReport(study).map((sentence) => {
    const li = document.createElement("li");
    li.textContent = sentence;
    return li;
  }));
  $("report").hidden = false;
  if (study.status === "closed") {
    say("study-status", "The signature verifies, but the study is closed: it accepts no records.",
      "error");
    return study;
  }
  say("study-status", `Signature verified with the pinned key ${study.keyId}.`, "ok");
  $("record-one-server").hidden = isTwoServer(study);
  $("record-two-server").hidden = !isTwoServer(study);
  $("x-hint").textContent = String(study.study.d);
  $("y-hint").textContent = study.study.loss === "logistic" ? "(−1 or +1)" : "(a number)";
  const schema = study.study.schema;
  $("row-fields").hidden = schema === null;
  $("xy-fields").hidden = schema !== null;
  input("x").required = input("y").required = schema === null;
  if (schema !== null) showRowFields(schema);
  $("example-section").hidden = false;
  return study;
}

const rangeText = (min: number, max: number) => `${min} – ${max}`;

/** One field per named column, labelled with its public range; a class target is a choice. */
function showRowFields(schema: Schema) {
  const fields = $("row-fields");
  fields.querySelectorAll("label").forEach((label) => label.remove());
  const field = (name: string, hint: string, control: HTMLInputElement | HTMLSelectElement) => {
    const label = document.createElement("label");
    const range = document.createElement("span");
    range.className = "range";
    range.textContent = hint;
    control.dataset["column"] = name;
    control.required = true;
    label.append(`${name} `, range, control);
    fields.append(label);
  };
  const numberInput = () => {
    const el = document.createElement("input");
    el.inputMode = "decimal";
    el.autocomplete = "off";
    return el;
  };
  for (const f of schema.features) field(f.name, `(${rangeText(f.min, f.max)})`, numberInput());
  const t = schema.target;
  if (t.classes !== undefined) {
    const select = document.createElement("select");
    select.append(...t.classes.map((c) => new Option(c, c)));
    field(t.name, `(${t.classes.join(" or ")})`, select);
  } else {
    field(t.name, `(${rangeText(t.min!, t.max!)})`, numberInput());
  }
}

function typedRow(): RawRow {
  const row: Record<string, string> = {};
  $("row-fields").querySelectorAll<HTMLInputElement | HTMLSelectElement>("[data-column]")
    .forEach((el) => { row[el.dataset["column"]!] = el.value; });
  return row;
}

function encoded(schema: Schema, row: RawRow): Example {
  const { x, y, clipped } = encodeRow(schema, row);
  return { x: Array.from(x), y, clipped };
}

/** "area (20 – 150), rent (0 – 2500)": the clipped columns with the range they were clipped to. */
function clippedText(schema: Schema, names: readonly string[]): string {
  return names.map((name) => {
    const f = schema.features.find((g) => g.name === name) ?? schema.target;
    return `${name} (${rangeText(f.min!, f.max!)})`;
  }).join(", ");
}

/** Numbers from "1, 2.5, -3": every entry must parse; an empty entry is an error, not a 0. */
function parseNumbers(text: string): number[] {
  return text.split(",").map((part) => (part.trim() === "" ? NaN : Number(part)));
}

function typedExample(): Example {
  const schema = verified?.study.schema ?? null;
  if (schema !== null) return encoded(schema, typedRow());
  return { x: parseNumbers(input("x").value), y: Number(input("y").value.trim() || NaN) };
}

const show = (values: Float64Array) => `[${Array.from(values, (v) => v.toPrecision(6)).join(", ")}]`;

function showRecord(record: PreparedRecord) {
  $("record-id").textContent = record.recordId;
  $("record-created").textContent = new Date(record.createdMs).toISOString();
  $("record-q").textContent = show(record.qNoisy);
  $("record-p").textContent = show(record.pNoisy);
  document.querySelectorAll(".record-size").forEach((el) => {
    el.textContent = String(record.bytes.length);
  });
  $("record-hex").textContent = toHex(record.bytes);
  $("record-section").hidden = false;
}

/** The study's record of (x, y): version 1, or version 3 for a two-server study. */
async function prepare(study: VerifiedStudy, x: readonly number[], y: number): Promise<PreparedRecord> {
  if (!isTwoServer(study)) return prepareRecord(study, x, y);
  return (await import("../src/two-server.js")).prepareTwoServerRecord(study, x, y);
}

const isTwoServer = (study: VerifiedStudy) => (study.study.fields["two_server"] ?? null) !== null;

async function prepareTyped() {
  if (verified === null) return;
  try {
    const { x, y, clipped = [] } = typedExample();
    prepared = await prepare(verified, x, y);
    showRecord(prepared);
    const schema = verified.study.schema;
    say("example-status", "Prepared with fresh noise. Nothing has been sent yet." +
      (schema !== null && clipped.length > 0
        ? ` Outside its public range, so clipped to it: ${clippedText(schema, clipped)}.` : ""),
      "ok");
    say("send-status", "");
    $<HTMLButtonElement>("send").disabled = false;
  } catch (error) {
    prepared = null;
    $("record-section").hidden = true;
    say("example-status", explain(error), "error");
  }
}

async function sendPrepared() {
  if (verified === null || prepared === null) return;
  const button = $<HTMLButtonElement>("send");
  button.disabled = true;
  say("send-status", "Sending…");
  try {
    await sendRecord(gatewayUrl(), verified.study.studyId, prepared.bytes);
    say("send-status", `Accepted: record ${prepared.recordId} is on its way into the next model. ` +
      "This page sends one record per study; a second copy of the same example with fresh " +
      "noise would reveal more about it.", "ok");
    $<HTMLFormElement>("example-form").querySelector("button")!.disabled = true;
    say("example-status", "");
  } catch (error) {
    say("send-status", explain(error), "error");
    button.disabled = false;
  }
}

/** Test hook: perturb and send k records, one per POST, as k simulated devices would. */
async function contributeMany(k: number, options: ManyOptions = {}): Promise<ManyResult> {
  const study = verified ?? await loadStudy();
  const schema = study.study.schema;
  const examples = options.rows !== undefined && schema !== null
    ? options.rows.map((row) => encoded(schema, row))
    : options.examples ?? [typedExample()];
  const records = await Promise.all(Array.from({ length: k }, (_, i) => {
    const { x, y } = examples[i % examples.length]!;
    return prepare(study, x, y);
  }));
  let accepted = 0;
  let next = 0;
  const device = async () => {
    while (next < records.length) {
      const record = records[next++]!;
      // Awaited first: `accepted += await …` would read accepted before the other devices add.
      const sent = await sendRecord(gatewayUrl(), study.study.studyId, record.bytes);
      accepted += sent;
    }
  };
  await Promise.all(Array.from({ length: Math.min(options.concurrency ?? 6, k) }, device));
  if (records.length > 0) showRecord(records[records.length - 1]!);
  say("send-status", `The test hook contributed ${accepted} records.`, "ok");
  return {
    recordIds: records.map((r) => r.recordId),
    records: records.map((r) => toHex(r.bytes)),
    q: records.map((r) => Array.from(r.qNoisy)),
    p: records.map((r) => Array.from(r.pNoisy)),
    accepted,
  };
}

async function start() {
  const params = new URLSearchParams(location.search);
  input("gateway").value = params.get("gateway") ?? location.origin;
  input("study").value = params.get("study") ?? "";
  input("key").value = params.get("key") ?? "";
  $("study-form").addEventListener("submit", (event) => {
    event.preventDefault();
    loadStudy().catch((error) => say("study-status", explain(error), "error"));
  });
  $("example-form").addEventListener("submit", (event) => {
    event.preventDefault();
    void prepareTyped();
  });
  $("send").addEventListener("click", () => void sendPrepared());
  window.ipdpContributeMany = contributeMany;
  if (input("study").value && input("key").value) {
    await loadStudy().catch((error) => say("study-status", explain(error), "error"));
  }
}

window.ipdpReady = start();
