/**
 * The client against a stand-in gateway on a real local HTTP server, answering as the
 * contract says: the signed envelope at GET /studies/{id}, 202 {"accepted": k} for records.
 */

import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, beforeEach, test } from "node:test";

import {
  contribute, credentialRecordId, fetchStudy, IpdpError, parseCredential, sendRecords,
  slotRecordId, studyUrl, toHex,
} from "../src/index.js";
import { closedStudy, openStudy, vectors, type Envelope } from "./vectors.js";

const OPEN_ID: string = JSON.parse(openStudy.envelope.study).study_id;
const CLOSED_ID: string = JSON.parse(closedStudy.envelope.study).study_id;
const D: number = JSON.parse(openStudy.envelope.study).d;
const KEY = vectors.keys.owner_public_key;
const CREDENTIALED_ID: string = JSON.parse(vectors.credentials.envelope.study).study_id;

interface Posted {
  contentType: string | undefined;
  authorization: string | undefined;
  body: Buffer;
  /** When the request's body was in (ms since the epoch). */
  at: number;
}

/** What the stand-in gateway serves and what it has received. */
const gateway = {
  studies: new Map<string, Envelope>(),
  posted: [] as Posted[],
  /** Answers to give to the next POSTs, in order, before accepting normally. */
  refusals: [] as { status: number; error: string; headers?: Record<string, string> }[],
  url: "",
};

function reply(res: ServerResponse, status: number, body: unknown, headers = {}) {
  res.writeHead(status, { "content-type": "application/json", ...headers });
  res.end(JSON.stringify(body));
}

async function handle(req: IncomingMessage, res: ServerResponse) {
  const chunks: Buffer[] = [];
  for await (const chunk of req) chunks.push(chunk as Buffer);
  const match = /^\/gw\/studies\/([^/]+)(\/records)?$/.exec(req.url ?? "");
  const envelope = match ? gateway.studies.get(decodeURIComponent(match[1]!)) : undefined;
  if (!match || envelope === undefined) {
    return reply(res, 404, { error: "unknown_study", detail: "no such study" });
  }
  if (req.method === "GET" && !match[2]) return reply(res, 200, envelope);
  gateway.posted.push({ contentType: req.headers["content-type"],
    authorization: req.headers["authorization"], body: Buffer.concat(chunks), at: Date.now() });
  const refusal = gateway.refusals.shift();
  if (refusal) {
    return reply(res, refusal.status, { error: refusal.error, detail: "stand-in refusal" },
      refusal.headers);
  }
  const body = Buffer.concat(chunks);
  const d: number = JSON.parse(envelope.study).d;
  const size = 48 + 16 * d;
  if (body.length === 0 || body.length % size) {
    return reply(res, 400, { error: "wrong_dimension", detail: `records of d = ${d} expected` });
  }
  return reply(res, 202, { accepted: body.length / size });
}

const server = createServer((req, res) => void handle(req, res));

before(async () => {
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  gateway.url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/gw`;
});
after(() => new Promise<void>((resolve) => server.close(() => resolve())));
beforeEach(() => {
  gateway.studies = new Map([[OPEN_ID, openStudy.envelope], [CLOSED_ID, closedStudy.envelope],
    [CREDENTIALED_ID, vectors.credentials.envelope]]);
  gateway.posted = [];
  gateway.refusals = [];
});

function failure(reason: string, detailPart = "") {
  return (e: unknown) =>
    e instanceof IpdpError && e.reason === reason && e.detail.includes(detailPart);
}

const x = Array.from({ length: D }, (_, i) => (i % 3) - 1);

test("contribute sends one record whose bytes hold the q̃, p̃ and id it returns", async () => {
  const c = await contribute(gateway.url, OPEN_ID, KEY, x, 0.5);
  assert.equal(gateway.posted.length, 1);
  const { contentType, body } = gateway.posted[0]!;
  assert.equal(contentType, "application/octet-stream");
  assert.deepEqual(new Uint8Array(body), c.record.bytes);
  assert.equal(body.subarray(8, 24).toString("hex"), openStudy.study_hash);
  assert.equal(body.subarray(24, 40).toString("hex"), c.recordId);
  assert.equal(body.readBigInt64LE(40), BigInt(c.record.createdMs));
  for (let i = 0; i < D; i++) {
    assert.ok(Object.is(body.readDoubleLE(48 + 8 * i), c.record.qNoisy[i]));
    assert.ok(Object.is(body.readDoubleLE(48 + 8 * (D + i)), c.record.pNoisy[i]));
  }
  assert.ok(Math.abs(c.record.createdMs - Date.now()) < 60_000);
});

test("fixed noise, id and time give the record Python would encode", async () => {
  const v = vectors.records.find((r) => r.study_hash === openStudy.study_hash && r.x.length === D)!;
  const c = await contribute(gateway.url, OPEN_ID, KEY, v.x, v.y, {
    noise: { u: Float64Array.from(v.u), r: Float64Array.from(v.r) },
    recordId: Buffer.from(v.record_id, "hex"),
    createdMs: v.created_ms,
  });
  assert.equal(gateway.posted[0]!.body.toString("hex"), v.record);
  assert.equal(c.recordId, v.record_id);
});

test("an unknown study is refused as unknown_study", async () => {
  await assert.rejects(contribute(gateway.url, "no-such-study", KEY, x, 1),
    failure("unknown_study", "404"));
});

test("a closed study is refused as closed_study and nothing is sent", async () => {
  await assert.rejects(contribute(gateway.url, CLOSED_ID, KEY, [1, 2, 3], 1),
    failure("closed_study", CLOSED_ID));
  assert.equal(gateway.posted.length, 0);
});

test("a forged study is refused as bad_signature and nothing is sent", async () => {
  const env = openStudy.envelope;
  gateway.studies.set(OPEN_ID, { ...env, study: env.study.replace('"n":10000', '"n":10') });
  await assert.rejects(contribute(gateway.url, OPEN_ID, KEY, x, 1), failure("bad_signature"));
  gateway.studies.set(OPEN_ID, openStudy.envelope);
  await assert.rejects(contribute(gateway.url, OPEN_ID, vectors.keys.stranger_public_key, x, 1),
    failure("bad_signature", "not pinned"));
  assert.equal(gateway.posted.length, 0);
});

test("a gateway that serves another signed study under this id is refused", async () => {
  gateway.studies.set(OPEN_ID, { ...closedStudy.envelope });
  await assert.rejects(fetchStudy(gateway.url, OPEN_ID, KEY), failure("bad_study", CLOSED_ID));
});

test("x of the wrong dimension is refused on the device, before anything is sent", async () => {
  await assert.rejects(contribute(gateway.url, OPEN_ID, KEY, [1, 2], 1),
    failure("wrong_dimension", `d = ${D}`));
  assert.equal(gateway.posted.length, 0);
});

test("the gateway's refusals keep their reason: wrong_dimension, closed_study, too_large", async () => {
  gateway.refusals.push({ status: 400, error: "wrong_dimension" });
  await assert.rejects(contribute(gateway.url, OPEN_ID, KEY, x, 1),
    (e) => failure("wrong_dimension")(e) && (e as IpdpError).status === 400);
  gateway.refusals.push({ status: 409, error: "closed_study" });
  await assert.rejects(contribute(gateway.url, OPEN_ID, KEY, x, 1), failure("closed_study", "409"));
  gateway.refusals.push({ status: 413, error: "too_large" });
  await assert.rejects(contribute(gateway.url, OPEN_ID, KEY, x, 1),
    (e) => e instanceof IpdpError && e.reason === "gateway_refused" &&
      e.gatewayReason === "too_large" && e.status === 413 && !e.retryable);
  assert.equal(gateway.posted.length, 3, "4xx other than 429 is not retried");
});

test("a retryable refusal is retried with the same bytes, and then succeeds", async () => {
  gateway.refusals.push({ status: 503, error: "kafka_unavailable" },
    { status: 429, error: "rate_limited", headers: { "retry-after": "0" } });
  const c = await contribute(gateway.url, OPEN_ID, KEY, x, 1, { retryDelayMs: 1 });
  assert.equal(gateway.posted.length, 3);
  for (const p of gateway.posted) assert.deepEqual(new Uint8Array(p.body), c.record.bytes);
});

test("a 429 is sent again no sooner than its Retry-After, with the same bytes", async () => {
  gateway.refusals.push({ status: 429, error: "rate_limited", headers: { "retry-after": "1" } });
  const c = await contribute(gateway.url, OPEN_ID, KEY, x, 1, { retryDelayMs: 1 });
  assert.equal(gateway.posted.length, 2);
  const [first, second] = gateway.posted;
  assert.ok(second!.at - first!.at >= 1000,
    `sent again ${second!.at - first!.at} ms after a Retry-After of 1 s`);
  assert.deepEqual(new Uint8Array(second!.body), c.record.bytes);
});

test("when retries run out the last refusal is reported with the gateway's reason", async () => {
  gateway.refusals.push(...Array.from({ length: 3 }, () => ({ status: 429, error: "rate_limited" })));
  await assert.rejects(contribute(gateway.url, OPEN_ID, KEY, x, 1, { retries: 2, retryDelayMs: 1 }),
    (e) => e instanceof IpdpError && e.reason === "gateway_refused" &&
      e.gatewayReason === "rate_limited" && e.status === 429 && e.retryable);
  assert.equal(gateway.posted.length, 3);
});

test("an unreachable gateway is reported as gateway_unreachable", async () => {
  await assert.rejects(
    fetchStudy("http://127.0.0.1:9/", OPEN_ID, KEY, { retries: 1, retryDelayMs: 1 }),
    (e) => failure("gateway_unreachable")(e) && (e as IpdpError).retryable);
});

test("a device's record goes alone in its own POST", async () => {
  const study = await fetchStudy(gateway.url, OPEN_ID, KEY);
  const { prepareRecord, sendRecord } = await import("../src/index.js");
  const before = gateway.posted.length;
  const record = prepareRecord(study, x, 1).bytes;
  assert.equal(await sendRecord(gateway.url, OPEN_ID, record), 1);
  assert.equal(gateway.posted.length, before + 1);
  assert.deepEqual(new Uint8Array(gateway.posted[before]!.body), record);
});

test("several records go in one POST and all must be accepted", async () => {
  const study = await fetchStudy(gateway.url, OPEN_ID, KEY);
  const { prepareRecord } = await import("../src/index.js");
  const records = [1, 2, 3].map((y) => prepareRecord(study, x, y).bytes);
  assert.equal(await sendRecords(gateway.url, OPEN_ID, records), 3);
  assert.equal(gateway.posted[0]!.body.length, 3 * (48 + 16 * D));
  assert.throws(() => prepareRecord({ ...study, status: "closed" }, x, 1), failure("closed_study"));
});

test("study URLs work with and without a trailing slash and a path prefix", () => {
  assert.equal(studyUrl("http://h:1", "a b"), "http://h:1/studies/a%20b");
  assert.equal(studyUrl("http://h:1/gw/", "s", "records"), "http://h:1/gw/studies/s/records");
  assert.equal(studyUrl("http://h:1/gw", "s", "records"), "http://h:1/gw/studies/s/records");
});

test("a study that requires credentials gets the credential and a record id in its slot", async () => {
  const v = vectors.credentials;
  const x3 = [0.1, -0.2, 0.3];
  const c = await contribute(gateway.url, CREDENTIALED_ID, KEY, x3, 0.5,
    { credential: v.credential, slot: 2, createdMs: v.issued_ms });
  assert.equal(c.recordId, v.slot_record_ids[2]);
  assert.equal(gateway.posted.length, 1);
  assert.equal(gateway.posted[0]!.authorization, `IPDP-Credential ${v.credential}`);
  assert.equal(gateway.posted[0]!.body.subarray(24, 40).toString("hex"), v.slot_record_ids[2]);
});

test("without a credential, or with one it cannot use, nothing is sent", async () => {
  const v = vectors.credentials;
  const x3 = [0.1, -0.2, 0.3];
  await assert.rejects(contribute(gateway.url, CREDENTIALED_ID, KEY, x3, 0.5),
    failure("credential_required"));
  await assert.rejects(contribute(gateway.url, CREDENTIALED_ID, KEY, x3, 0.5,
    { credential: v.credential, slot: v.records_per_device, createdMs: v.issued_ms }),
    failure("bad_credential", "slot"));
  await assert.rejects(contribute(gateway.url, CREDENTIALED_ID, KEY, x3, 0.5,
    { credential: "not a credential" }), failure("bad_credential", "base64url"));
  // Expired by now (issued for 2023), and a credential offered to another study.
  const expired = contribute(gateway.url, CREDENTIALED_ID, KEY, x3, 0.5, { credential: v.credential });
  await assert.rejects(expired, failure("bad_credential", "expired"));
  const plain = await fetchStudy(gateway.url, OPEN_ID, KEY);
  await assert.rejects(credentialRecordId(plain, v.credential, 0, v.issued_ms),
    failure("bad_credential", "study hash"));
  assert.equal(gateway.posted.length, 0);
});

test("a credential's fields and slots are the Python implementation's, in either version", async () => {
  for (const v of [vectors.credentials, vectors.batch_credential]) {
    const credential = parseCredential(v.credential);
    assert.equal(toHex(credential.credentialId), v.credential_id);
    assert.equal(toHex(credential.studyHash), v.study_hash);
    assert.equal(credential.issuedMs, v.issued_ms);
    assert.equal(credential.expiresMs, v.expires_ms);
    for (let slot = 0; slot < v.records_per_device; slot++) {
      assert.equal(toHex(await slotRecordId(credential.credentialId, slot)), v.slot_record_ids[slot]);
    }
  }
  // A version-2 credential whose length does not match its height is refused before any use.
  const batch = vectors.batch_credential.credential;
  assert.throws(() => parseCredential(batch.slice(0, -44)), failure("bad_credential", "version 2"));
  const verified = await fetchStudy(gateway.url, CREDENTIALED_ID, KEY);
  assert.equal(verified.study.requireCredentials, true);
  assert.equal(verified.study.recordsPerDevice, vectors.credentials.records_per_device);
  assert.equal((await fetchStudy(gateway.url, OPEN_ID, KEY)).study.requireCredentials, false);
});
