import assert from "node:assert/strict";
import { test } from "node:test";

import {
  clipPair, encodeExample, encodeRecord, fromHex, perturbWithNoise, recordSize, studyHash, toHex,
} from "../src/index.js";
import { sameDoubles, vectors } from "./vectors.js";

for (const c of vectors.records) {
  test(`record vector "${c.name}": encode, clip, noise and bytes match Python`, () => {
    const params = { loss: c.loss, d: c.x.length, lam: c.lam, pBound: c.p_bound };
    const clipped = clipPair(encodeExample(c.loss, c.x, c.y, params.d), c.lam, c.p_bound);
    assert.ok(sameDoubles(clipped.q, c.q), `q: ${clipped.q} vs ${c.q}`);
    assert.ok(sameDoubles(clipped.p, c.p), `p: ${clipped.p} vs ${c.p}`);
    const noisy = perturbWithNoise(params, c.x, c.y, {
      u: Float64Array.from(c.u), r: Float64Array.from(c.r),
    });
    assert.ok(sameDoubles(noisy.q, c.q_noisy));
    assert.ok(sameDoubles(noisy.p, c.p_noisy));
    const bytes = encodeRecord(
      fromHex(c.study_hash), fromHex(c.record_id), c.created_ms, noisy.q, noisy.p);
    assert.equal(toHex(bytes), c.record);
  });
}

for (const c of vectors.wire) {
  test(`wire vector "${c.name}": bytes match Python`, () => {
    const bytes = encodeRecord(fromHex(c.study_hash), fromHex(c.record_id), c.created_ms,
      Float64Array.from(c.q_noisy), Float64Array.from(c.p_noisy));
    assert.equal(bytes.length, recordSize(c.q_noisy.length));
    assert.equal(toHex(bytes), c.record);
  });
}

test("the vectors keep a negative zero through encoding and noise", () => {
  const c = vectors.records.find((r) => r.name.includes("negative zero"))!;
  assert.ok(Object.is(c.q_noisy[0], -0) && Object.is(c.p_noisy[0], -0));
  const bytes = fromHex(c.record);
  assert.equal(bytes[48 + 7], 0x80, "q̃[0] is stored with its sign bit");
});

test("the study hash is SHA-256 of the exact study text, truncated to 16 bytes", async () => {
  for (const s of vectors.studies) {
    assert.equal(toHex(await studyHash(s.envelope.study)), s.study_hash);
  }
  const openText = vectors.studies[0]!.envelope.study;
  assert.notEqual(toHex(await studyHash(openText.replace("{", "{ "))), vectors.studies[0]!.study_hash,
    "whitespace changes the hash: devices hash the text they received, never a re-serialisation");
});

test("encodeRecord refuses what Python's decoder would dead-letter", () => {
  const id = new Uint8Array(16);
  assert.throws(() => encodeRecord(id, id, 0, Float64Array.of(NaN), Float64Array.of(0)), RangeError);
  assert.throws(() => encodeRecord(id, id, 0, Float64Array.of(1, 2), Float64Array.of(0)), RangeError);
  assert.throws(() => encodeRecord(id, new Uint8Array(15), 0, Float64Array.of(1), Float64Array.of(0)),
    RangeError);
  assert.throws(() => encodeRecord(id, id, 0.5, Float64Array.of(1), Float64Array.of(0)), RangeError);
});
