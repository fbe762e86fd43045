import assert from "node:assert/strict";
import { test } from "node:test";

import {
  encodeRow, importTrustedKey, IpdpError, parseSchema, privacyReport, verifyStudyEnvelope,
} from "../src/index.js";
import { sameDoubles, vectors } from "./vectors.js";

function failure(reason: string, detailPart = "") {
  return (e: unknown) =>
    e instanceof IpdpError && e.reason === reason && e.detail.includes(detailPart);
}

test("a raw row encodes through the signed study's schema to Python's doubles, clips named", async () => {
  const owner = await importTrustedKey(vectors.keys.owner_public_key);
  for (const { envelope, rows } of vectors.schemas) {
    const { study } = await verifyStudyEnvelope(envelope, owner);
    assert.ok(study.schema !== null);
    for (const { row, x, y, clipped } of rows) {
      const encoded = encodeRow(study.schema, row);
      assert.ok(sameDoubles(encoded.x, x), `${JSON.stringify(row)}: ${encoded.x} ≠ ${x}`);
      assert.ok(Object.is(encoded.y, y), `${JSON.stringify(row)}: y ${encoded.y} ≠ ${y}`);
      assert.deepEqual(encoded.clipped, clipped);
    }
  }
  assert.ok(vectors.schemas.some((s) => s.rows.some((r) => r.clipped.length > 0)));
});

test("the page's text values parse as numbers; an empty or unknown value is refused", async () => {
  const owner = await importTrustedKey(vectors.keys.owner_public_key);
  const [rents, loans] = await Promise.all(
    vectors.schemas.map((s) => verifyStudyEnvelope(s.envelope, owner)));
  const row = vectors.schemas[0]!.rows[0]!;
  const asText = Object.fromEntries(Object.entries(row.row).map(([k, v]) => [k, ` ${v} `]));
  assert.ok(sameDoubles(encodeRow(rents!.study.schema!, asText).x, row.x));
  assert.throws(() => encodeRow(rents!.study.schema!, { ...row.row, area: "" }),
    failure("invalid_example", "area"));
  assert.throws(() => encodeRow(loans!.study.schema!, { income: 1, debt: 1, approved: "maybe" }),
    failure("invalid_example", "approved"));
});

test("a schema that does not give the study's d, or a logistic target without classes, is refused", () => {
  const schema = { features: [{ name: "a", min: 0, max: 1 }], target: { name: "t", min: 0, max: 1 },
    intercept: true };
  assert.equal(parseSchema(schema, 2, "squared").features[0]!.name, "a");
  assert.throws(() => parseSchema(schema, 3, "squared"), failure("bad_study", "d = 2"));
  assert.throws(() => parseSchema(schema, 2, "logistic"), failure("bad_study", "two classes"));
  assert.throws(() => parseSchema({ ...schema, features: [{ name: "a", min: 1, max: 1 }] }, 2,
    "squared"), failure("bad_study", "min < max"));
});

test("the privacy report of a schema study names what it predicts from what", async () => {
  const owner = await importTrustedKey(vectors.keys.owner_public_key);
  const [first] = privacyReport(await verifyStudyEnvelope(vectors.schemas[0]!.envelope, owner));
  assert.equal(first, "Study web-vectors-schema trains a linear regression (squared loss) " +
    "predicting rent from area, floor, distance km and an intercept (d = 4); each value is " +
    "mapped through its public range, and clipped to it, on this device.");
});
