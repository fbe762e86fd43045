/**
 * A study's schema: the named features and target of a raw row, each with its public range, and
 * the encoding a device applies to its own row (ipdp/schema.py, docs/privacy.md):
 *
 *     u_j = 2·(clip(v_j, min_j, max_j) − min_j)/(max_j − min_j) − 1
 *     x   = (1, u_1, …, u_k)/√d with the intercept (d = k + 1), else (u_1, …, u_k)/√d
 *     y   = the numeric target mapped the same way, or −1 / +1 for the first / second class
 *
 * computed operation for operation as Python does, so the same row gives the same doubles. A value
 * outside its range is clipped to it, and the row says which columns were.
 */

import { IpdpError } from "./errors.js";

/** The loss a study trains with (a study's `loss`, re-exported by study.ts). */
export type Loss = "squared" | "logistic";

export interface SchemaFeature {
  readonly name: string;
  readonly min: number;
  readonly max: number;
}

/** A number in [min, max] (squared loss), or one of two named classes (logistic loss). */
export interface SchemaTarget {
  readonly name: string;
  readonly min?: number;
  readonly max?: number;
  readonly classes?: readonly [string, string];
}

export interface Schema {
  readonly features: readonly SchemaFeature[];
  readonly target: SchemaTarget;
  readonly intercept: boolean;
}

/** One raw row encoded for its study, and the columns whose value was clipped to its range. */
export interface EncodedRow {
  readonly x: Float64Array;
  readonly y: number;
  readonly clipped: readonly string[];
}

/** A raw row: column name → value (a number, or text a number parses from, or a class name). */
export type RawRow = Readonly<Record<string, number | string>>;

/** The schema of a signed study text, checked against the study's d and loss. */
export function parseSchema(value: unknown, d: number, loss: Loss): Schema {
  if (!isObject(value) || !Array.isArray(value["features"]) || value["features"].length === 0) {
    throw new IpdpError("bad_study", "the study's schema has no features");
  }
  const features = value["features"].map((f: unknown) => {
    if (!isObject(f) || typeof f["name"] !== "string") {
      throw new IpdpError("bad_study", "a schema feature has no name");
    }
    return { name: f["name"], ...range(f, f["name"]) };
  });
  const t = value["target"];
  if (!isObject(t) || typeof t["name"] !== "string") {
    throw new IpdpError("bad_study", "the study's schema has no target name");
  }
  let target: SchemaTarget;
  if (loss === "logistic") {
    const classes = t["classes"];
    if (!Array.isArray(classes) || classes.length !== 2 ||
        !classes.every((c) => typeof c === "string")) {
      throw new IpdpError("bad_study", `target ${t["name"]} of a logistic study names no two classes`);
    }
    target = { name: t["name"], classes: [classes[0], classes[1]] };
  } else {
    target = { name: t["name"], ...range(t, t["name"]) };
  }
  const intercept = value["intercept"];
  if (typeof intercept !== "boolean") {
    throw new IpdpError("bad_study", "the study's schema does not say whether it has an intercept");
  }
  const schema = { features, target, intercept };
  if (schemaDimension(schema) !== d) {
    throw new IpdpError("bad_study", `the schema gives d = ${schemaDimension(schema)}, the study ` +
      `says d = ${d}`);
  }
  return schema;
}

/** One coordinate per feature, plus one for the intercept. */
export function schemaDimension(schema: Schema): number {
  return schema.features.length + (schema.intercept ? 1 : 0);
}

/** Encode one raw row through the schema: x (d), y, and the columns clipped to their range. */
export function encodeRow(schema: Schema, row: RawRow): EncodedRow {
  const d = schemaDimension(schema);
  const rootD = Math.sqrt(d);
  const clipped: string[] = [];
  const x = new Float64Array(d);
  let i = 0;
  if (schema.intercept) x[i++] = 1.0 / rootD;
  for (const f of schema.features) {
    const v = number(row, f.name);
    if (v < f.min || v > f.max) clipped.push(f.name);
    // a·clip(v) + c with a = 2/((max − min)·√d), c = −(max + min)/((max − min)·√d), as Python.
    const a = 2.0 / ((f.max - f.min) * rootD);
    const c = -(f.max + f.min) / ((f.max - f.min) * rootD);
    x[i++] = a * Math.min(Math.max(v, f.min), f.max) + c;
  }
  const t = schema.target;
  let y: number;
  if (t.classes !== undefined) {
    const label = String(row[t.name] ?? "").trim();
    if (!t.classes.includes(label)) {
      throw new IpdpError("invalid_example", `${t.name} is ${JSON.stringify(label)}, not one of ` +
        `${t.classes.map((c) => JSON.stringify(c)).join(", ")}`);
    }
    y = label === t.classes[1] ? 1.0 : -1.0;
  } else {
    const lo = t.min!, hi = t.max!;
    const v = number(row, t.name);
    if (v < lo || v > hi) clipped.push(t.name);
    y = (2.0 * (Math.min(Math.max(v, lo), hi) - lo)) / (hi - lo) - 1.0;
  }
  return { x, y, clipped };
}

function number(row: RawRow, name: string): number {
  const raw = row[name];
  const v = typeof raw === "string" ? (raw.trim() === "" ? NaN : Number(raw)) : raw;
  if (typeof v !== "number" || !Number.isFinite(v)) {
    throw new IpdpError("invalid_example", `${name} is ${JSON.stringify(raw ?? null)}, not a ` +
      "finite number");
  }
  return v;
}

function range(obj: Record<string, unknown>, name: string): { min: number; max: number } {
  const min = obj["min"], max = obj["max"];
  if (typeof min !== "number" || typeof max !== "number" || !Number.isFinite(min) ||
      !Number.isFinite(max) || !(min < max)) {
    throw new IpdpError("bad_study", `${name}'s range [${String(min)}, ${String(max)}] is not ` +
      "two finite numbers, min < max");
  }
  return { min, max };
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}
