import assert from "node:assert/strict";
import { test } from "node:test";

import {
  fromHex, importTrustedKey, prepareRecord, privacyReport, toHex, verifyStudyEnvelope,
} from "../src/index.js";
import {
  encodeFixedPoint, encodeTwoServerRecord, fromShareBytes, leaderShare, openShare,
  prepareTwoServerRecord, roundHalfEven, sealShare, shareBytes, twoServerHeader, twoServerLayout,
  twoServerParameters,
} from "../src/two-server.js";
import { vectors } from "./vectors.js";

const two = vectors.two_server;
const helperPrivate = fromHex(two.helper_private_key);

async function verifiedTwoServerStudy() {
  const key = await importTrustedKey(vectors.keys.owner_public_key);
  return verifyStudyEnvelope(two.envelope, [key]);
}

test("roundHalfEven rounds ties to even, as numpy's rint (Math.round does not)", () => {
  assert.deepEqual([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999999999999994, 2 ** 52 + 1]
    .map(roundHalfEven), [0, 2, 2, -0, -2, -2, 0, 2 ** 52 + 1]);
  assert.equal(Math.round(2.5), 3);
});

test("a two-server study's record is never version 1", async () => {
  const verified = await verifiedTwoServerStudy();
  assert.throws(() => prepareRecord(verified, new Array(14).fill(0), 0), /two-server/);
});

test("a record at d = 14 is 2,004 bytes in the documented order", () => {
  assert.deepEqual(twoServerLayout(14), {
    entries: 119, shareSize: 952, leader: 48, sealed: 1000, proofLength: 2000, size: 2004,
  });
});

test("the signed two-server study names its helper and the encoding", async () => {
  const verified = await verifiedTwoServerStudy();
  assert.equal(toHex(verified.studyHash), two.study_hash);
  const params = twoServerParameters(verified.study)!;
  assert.equal(params.helperKey, two.helper_public_key);
  assert.equal(params.helperId, "helper-a");
  assert.equal(params.fractionBits, two.cases.at(-1)!.fraction_bits);
});

test("the privacy report of a two-server study says who holds the shares", async () => {
  const report = privacyReport(await verifiedTwoServerStudy());
  const text = report.join(" ");
  assert.match(text, /This is a two-server study: .* sealed to the helper helper-a \(https:\/\//);
  assert.match(text, /only the sum of a whole round of n records is put back together/);
  // The one-server sentence (each record readable by the service) is not there.
  assert.doesNotMatch(text, /guard the records it receives like raw data/);
});

for (const c of two.cases) {
  test(`two-server vector "${c.name}": ring values, leader share and unsealed bytes match Python`,
    async () => {
      const { values, clamped } = encodeFixedPoint(c.q_tilde, c.p_hat, c.fraction_bits,
                                                   c.clamp_log2);
      assert.deepEqual([...values].map(String), c.values);
      assert.equal(clamped, c.clamped);
      const helper = fromShareBytes(fromHex(c.helper_share));
      assert.equal(toHex(shareBytes(leaderShare(values, helper))), c.leader_share);
      const header = twoServerHeader(fromHex(c.study_hash), fromHex(c.record_id), c.created_ms,
                                     c.d);
      assert.equal(toHex(header), c.header);
      const sealed = await sealShare(Buffer.from(two.helper_public_key, "base64"),
                                     shareBytes(helper), header);
      assert.equal(sealed.length, 8 * helper.length + 48);
      assert.equal(toHex(await openShare(helperPrivate, sealed, header)), c.helper_share);
      const stranger = new Uint8Array(32).fill(7);
      await assert.rejects(openShare(stranger, sealed, header));
    });

  test(`two-server vector "${c.name}": TypeScript opens Python's seal, and only under its header`,
    async () => {
      const layout = twoServerLayout(c.d);
      const record = fromHex(c.record);
      assert.equal(record.length, layout.size);
      assert.equal(toHex(record.subarray(0, layout.sealed)), c.unsealed);
      assert.deepEqual([...record.subarray(layout.proofLength)], [0, 0, 0, 0]);
      const sealed = record.subarray(layout.sealed, layout.proofLength);
      const header = fromHex(c.header);
      assert.equal(toHex(await openShare(helperPrivate, sealed, header)), c.helper_share);
      header[40]! ^= 1;
      await assert.rejects(openShare(helperPrivate, sealed, header));
    });
}

test("prepareTwoServerRecord with the vector's inputs gives Python's unsealed bytes, and its " +
  "seal opens to the helper share", async () => {
  const verified = await verifiedTwoServerStudy();
  const c = two.cases.at(-1)!;
  const prepared = await prepareTwoServerRecord(verified, [], 0, {
    perturbed: { qTilde: Float64Array.from(c.q_tilde), pHat: Float64Array.from(c.p_hat) },
    helperShare: fromShareBytes(fromHex(c.helper_share)),
    recordId: fromHex(c.record_id),
    createdMs: c.created_ms,
  });
  const layout = twoServerLayout(c.d);
  assert.equal(toHex(prepared.bytes.subarray(0, layout.sealed)), c.unsealed);
  assert.equal(prepared.bytes.length, layout.size);
  const opened = await openShare(helperPrivate, prepared.bytes.slice(layout.sealed,
    layout.proofLength), fromHex(c.header));
  assert.equal(toHex(opened), c.helper_share);
});

test("a device's record: the shares sum to its fixed-point values and the helper's is sealed",
  async () => {
    const verified = await verifiedTwoServerStudy();
    const params = twoServerParameters(verified.study)!;
    const x = Array.from({ length: 14 }, (_, i) => (i - 7) / 40);
    const prepared = await prepareTwoServerRecord(verified, x, 0.3);
    const layout = twoServerLayout(14);
    const bytes = prepared.bytes;
    assert.equal(bytes[0], 3);
    const leader = fromShareBytes(bytes.slice(layout.leader, layout.sealed));
    const header = bytes.slice(0, 48);
    const helper = fromShareBytes(await openShare(
      helperPrivate, bytes.slice(layout.sealed, layout.proofLength), header));
    const { values } = encodeFixedPoint(prepared.qNoisy, prepared.pNoisy, params.fractionBits,
                                        params.clampLog2);
    const sum = leader.map((w, i) => BigInt.asUintN(64, w + helper[i]!));
    assert.deepEqual([...sum], [...values]);
    // p̂ lies on the linear grid 2^−f_b.
    for (const v of prepared.pNoisy) {
      assert.ok(Number.isInteger(v * 2 ** params.linearFractionBits));
    }
    // The helper share differs from the leader's and from the values: it is fresh randomness.
    assert.notDeepEqual([...helper], [...values]);
    assert.throws(() => encodeTwoServerRecord(header, leader.subarray(1), new Uint8Array(0)));
  });
