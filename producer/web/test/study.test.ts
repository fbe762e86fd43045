import assert from "node:assert/strict";
import { test } from "node:test";

import {
  importTrustedKey, IpdpError, requireOpen, signedMessage, toHex, verifyStudyEnvelope,
  type TrustedKey,
} from "../src/index.js";
import { closedStudy, openStudy, vectors, type Envelope } from "./vectors.js";

const owner = () => importTrustedKey(vectors.keys.owner_public_key);
const stranger = () => importTrustedKey(vectors.keys.stranger_public_key);

function failure(reason: string, detailPart = "") {
  return (e: unknown) =>
    e instanceof IpdpError && e.reason === reason && e.detail.includes(detailPart);
}

/** A study owner made up by the test, signing as the contract says. */
async function testOwner() {
  const pair = await crypto.subtle.generateKey({ name: "Ed25519" }, true, ["sign", "verify"]) as
    CryptoKeyPair;
  const raw = new Uint8Array(await crypto.subtle.exportKey("raw", pair.publicKey));
  const trusted = await importTrustedKey(Buffer.from(raw).toString("base64"));
  const sign = async (study: string, status = "open"): Promise<Envelope> => ({
    format: 2, study, status, key_id: trusted.keyId,
    signature: Buffer.from(await crypto.subtle.sign(
      { name: "Ed25519" }, pair.privateKey, signedMessage(status, study))).toString("base64"),
  });
  return { trusted, sign };
}

const studyFields = {
  d: 2, delta: 0.01, delta_in: null, epsilon: 1.0, eta: 1.0, lam: 1.0, loss: "squared",
  max_rounds: null, mode: "rigorous", n: 1000, noise: { std_p: 0.5, std_q: 0.05 }, p_bound: 1.0,
  study_id: "made-up",
};

test("the pinned key's id is SHA-256(raw key)[:8] as in the envelope", async () => {
  assert.equal((await owner()).keyId, vectors.keys.owner_key_id);
});

test("the signed message is the contract's context, status and study text", () => {
  for (const s of vectors.studies) {
    assert.equal(new TextDecoder().decode(signedMessage(s.envelope.status, s.envelope.study)),
      s.signed_message);
  }
});

test("a study signed by the pinned key verifies, with its parameters and wire hash", async () => {
  const v = await verifyStudyEnvelope(openStudy.envelope, await owner());
  assert.equal(v.status, "open");
  assert.equal(v.studyText, openStudy.envelope.study);
  assert.equal(toHex(v.studyHash), openStudy.study_hash);
  const fields = JSON.parse(openStudy.envelope.study);
  assert.equal(v.study.studyId, fields.study_id);
  assert.equal(v.study.d, fields.d);
  assert.equal(v.study.noise.stdQ, fields.noise.std_q);
  assert.equal(v.study.noise.stdP, fields.noise.std_p);
  assert.equal(v.study.pBound, fields.p_bound);
  assert.equal(requireOpen(v), v);
});

test("the envelope's JSON text verifies the same as the parsed object", async () => {
  const v = await verifyStudyEnvelope(JSON.stringify(openStudy.envelope), await owner());
  assert.equal(toHex(v.studyHash), openStudy.study_hash);
});

test("a closed study verifies, and requireOpen refuses it as closed_study", async () => {
  const v = await verifyStudyEnvelope(closedStudy.envelope, await owner());
  assert.equal(v.status, "closed");
  assert.throws(() => requireOpen(v), failure("closed_study", v.study.studyId));
});

test("a tampered study text is refused as bad_signature", async () => {
  const forged = openStudy.envelope.study.replace('"epsilon":1.0', '"epsilon":1000.0');
  assert.notEqual(forged, openStudy.envelope.study);
  await assert.rejects(verifyStudyEnvelope({ ...openStudy.envelope, study: forged }, await owner()),
    failure("bad_signature", "does not verify"));
  const noisier = openStudy.envelope.study.replace('"std_q":0.', '"std_q":1');
  await assert.rejects(verifyStudyEnvelope({ ...openStudy.envelope, study: noisier }, await owner()),
    failure("bad_signature", "does not verify"));
});

test("a tampered status is refused as bad_signature", async () => {
  await assert.rejects(
    verifyStudyEnvelope({ ...closedStudy.envelope, status: "open" }, await owner()),
    failure("bad_signature", "does not verify"));
});

test("a study signed by a key that is not pinned is refused as bad_signature", async () => {
  await assert.rejects(verifyStudyEnvelope(openStudy.envelope, await stranger()),
    failure("bad_signature", "not pinned"));
  const s = await stranger();
  const posing: TrustedKey = { keyId: vectors.keys.owner_key_id, key: s.key };
  await assert.rejects(verifyStudyEnvelope(openStudy.envelope, posing),
    failure("bad_signature", "does not verify"));
});

test("any one of several pinned keys may verify", async () => {
  const v = await verifyStudyEnvelope(openStudy.envelope, [await stranger(), await owner()]);
  assert.equal(v.keyId, vectors.keys.owner_key_id);
});

test("malformed signatures and keys are refused with their own reasons", async () => {
  const key = await owner();
  await assert.rejects(verifyStudyEnvelope({ ...openStudy.envelope, signature: "not base64!" }, key),
    failure("bad_signature", "base64"));
  await assert.rejects(verifyStudyEnvelope({ ...openStudy.envelope, signature: "AAAA" }, key),
    failure("bad_signature", "3 bytes"));
  await assert.rejects(importTrustedKey("AAAA"), failure("bad_key", "3 bytes"));
  await assert.rejects(importTrustedKey("-_-_"), failure("bad_key", "base64"));
  assert.equal((await importTrustedKey(`${vectors.keys.owner_public_key}\n`)).keyId,
    vectors.keys.owner_key_id, "a .pub file's line ending is fine");
});

test("an envelope of another format or shape is refused as bad_study", async () => {
  const key = await owner();
  await assert.rejects(verifyStudyEnvelope({ ...openStudy.envelope, format: 1 }, key),
    failure("bad_study", "format 1"));
  await assert.rejects(verifyStudyEnvelope({ format: 2, study: "{}" }, key), failure("bad_study"));
  await assert.rejects(verifyStudyEnvelope("not json", key), failure("bad_study", "JSON"));
  await assert.rejects(verifyStudyEnvelope([], key), failure("bad_study", "object"));
});

test("fields this SDK does not know are kept, not refused", async () => {
  const { trusted, sign } = await testOwner();
  const text = JSON.stringify({ ...studyFields, budget: { epsilon: 10 }, x_bound: 3 });
  const v = await verifyStudyEnvelope(await sign(text), trusted);
  assert.deepEqual(v.study.fields["budget"], { epsilon: 10 });
  assert.equal(v.study.d, 2);
});

test("a validly signed study without what a device needs is refused as bad_study", async () => {
  const { trusted, sign } = await testOwner();
  const cases: [Record<string, unknown>, string][] = [
    [{ ...studyFields, loss: "hinge" }, "hinge"],
    [{ ...studyFields, noise: undefined }, "noise"],
    [{ ...studyFields, noise: { std_q: 0, std_p: 1 } }, "std_q"],
    [{ ...studyFields, d: 1.5 }, "d is 1.5"],
    [{ ...studyFields, lam: -1 }, "lam"],
    [{ ...studyFields, study_id: undefined }, "study_id"],
  ];
  for (const [fields, detail] of cases) {
    await assert.rejects(verifyStudyEnvelope(await sign(JSON.stringify(fields)), trusted),
      failure("bad_study", detail), detail);
  }
  await assert.rejects(verifyStudyEnvelope(await sign(JSON.stringify(studyFields), "paused"), trusted),
    failure("bad_study", "paused"));
});

test("the privacy report states ε, δ, n, the mode and the rounds in words", async () => {
  const { privacyReport } = await import("../src/index.js");
  const open = privacyReport(await verifyStudyEnvelope(openStudy.envelope, await owner())).join(" ");
  for (const part of ["n = 10,000", "ε = 1,", "δ = 0.01)", "of which 0.00001 is spent", "rigorous", "at most 3 models",
    "open, signed by the owner's key " + vectors.keys.owner_key_id]) {
    assert.ok(open.includes(part), `${part} in: ${open}`);
  }
  const closed = privacyReport(await verifyStudyEnvelope(closedStudy.envelope, await owner()));
  assert.ok(closed.join(" ").includes("paper's Algorithm 1"));
  assert.ok(closed.join(" ").includes("logistic loss"));
  assert.ok(closed.join(" ").includes("δ = 0.00001)"));
});
