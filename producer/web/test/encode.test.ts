import assert from "node:assert/strict";
import { test } from "node:test";

import { clipRow, encodeExample, IpdpError, norm } from "../src/index.js";

function failure(reason: string, detailPart: string) {
  return (e: unknown) =>
    e instanceof IpdpError && e.reason === reason && e.detail.includes(detailPart);
}

test("squared loss: q = x, p = y·x; logistic: q = x/2, p = y·x/2", () => {
  const sq = encodeExample("squared", [1, -2, 0.5], 3, 3);
  assert.deepEqual([...sq.q], [1, -2, 0.5]);
  assert.deepEqual([...sq.p], [3, -6, 1.5]);
  const lg = encodeExample("logistic", [1, -2, 0.5], -1, 3);
  assert.deepEqual([...lg.q], [0.5, -1, 0.25]);
  assert.deepEqual([...lg.p], [-0.5, 1, -0.25]);
});

test("a row outside the bound is scaled onto it, keeping its direction", () => {
  const v = Float64Array.of(3, -4, 12); // norm 13
  const clipped = clipRow(v, 2);
  assert.ok(Math.abs(norm(clipped) - 2) <= 4 * Number.EPSILON);
  for (let i = 0; i < v.length; i++) assert.ok(Math.abs(clipped[i]! - (v[i]! * 2) / 13) < 1e-15);
});

test("a row inside the bound, and the zero row, come back bit for bit", () => {
  const inside = Float64Array.of(0.1, -0.2, -0);
  const out = clipRow(inside, 1);
  for (let i = 0; i < 3; i++) assert.ok(Object.is(out[i], inside[i]));
  assert.deepEqual([...clipRow(new Float64Array(4), 1)], [0, 0, 0, 0]);
});

test("clipping leaves ‖q‖² ≤ λ up to rounding for large and tiny magnitudes", () => {
  for (const scale of [1e-300, 1e-5, 1, 1e5, 1e150]) {
    const v = Float64Array.from({ length: 50 }, (_, i) => scale * Math.sin(i + 1));
    const out = clipRow(v, Math.sqrt(0.25));
    assert.ok(norm(out) <= 0.5 * (1 + 4 * Number.EPSILON), `scale ${scale}: ${norm(out)}`);
  }
});

test("x of the wrong length is refused as wrong_dimension", () => {
  assert.throws(() => encodeExample("squared", [1, 2], 1, 3), failure("wrong_dimension", "d = 3"));
  assert.throws(() => encodeExample("squared", [], 1, 1), failure("wrong_dimension", "0 values"));
});

test("non-finite or non-numeric x and y are refused as invalid_example", () => {
  assert.throws(() => encodeExample("squared", [1, NaN], 1, 2), failure("invalid_example", "x[1]"));
  assert.throws(() => encodeExample("squared", [Infinity], 1, 1), failure("invalid_example", "x[0]"));
  assert.throws(() => encodeExample("squared", ["1"], 1, 1), failure("invalid_example", "x[0]"));
  assert.throws(() => encodeExample("squared", [1], NaN, 1), failure("invalid_example", "y is NaN"));
});

test("a logistic label other than −1 or +1 is refused", () => {
  for (const y of [0, 2, 0.5, -0.999]) {
    assert.throws(() => encodeExample("logistic", [1], y, 1), failure("invalid_example", "−1 or +1"));
  }
});
