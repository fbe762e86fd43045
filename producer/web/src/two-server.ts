/**
 * A two-server study's record, wire version 3 (docs/wire-format.md, "Two-server records"),
 * byte-identical to ipdp.two_server_wire for the same inputs and helper share:
 *
 *   header (48, a version-1 header with version 3) ‖ leader share (8L) ‖
 *   helper share sealed to the study's helper key (32 + 8L + 16) ‖ proof length (u32, 0)
 *
 * with L = d(d+3)/2 ring elements of Z_2^64: the upper triangle of q̃q̃ᵀ row by row, then p̂,
 * each rint(2^f·v) with ties to even (not Math.round, which rounds ties up), clamped to
 * ±2^(c+f). The helper's share is uniform words from `crypto.getRandomValues`, the leader's is
 * value − helper mod 2^64 (BigUint64Array arithmetic). The seal is HPKE (RFC 9180) base mode
 * with DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM from `@hpke/core`, info = the 48
 * header bytes, empty aad: only the helper opens it, and only under this record's header.
 */

import {
  Aes128Gcm, CipherSuite, DhkemX25519HkdfSha256, HkdfSha256,
} from "@hpke/core";
import poisson from "@stdlib/random-base-poisson";

import { fromBase64, toHex } from "./bytes.js";
import { clipPair, encodeExample } from "./encode.js";
import { IpdpError } from "./errors.js";
import { cryptoFill, gaussian, type RandomFill } from "./noise.js";
import { newRecordId, type PreparedRecord } from "./record.js";
import { requireOpen, type Study, type VerifiedStudy } from "./study.js";
import { HEADER_SIZE, ID_SIZE } from "./wire.js";

export const TWO_SERVER_WIRE_VERSION = 3;
/** What sealing adds to a share: the 32-byte encapsulated key and AES-GCM's 16-byte tag. */
export const SEAL_OVERHEAD = 48;
export const PROOF_LENGTH_SIZE = 4;
const RING = 1n << 64n;

/** A two-server study's helper and its devices' encoding (the study text's `two_server`). */
export interface TwoServerParameters {
  readonly helperId: string;
  readonly helperUrl: string;
  /** Standard base64 of the helper's raw X25519 public key. */
  readonly helperKey: string;
  /** f: a value v is the ring element rint(2^f·v). */
  readonly fractionBits: number;
  /** c: every entry is clamped to ±2^c. */
  readonly clampLog2: number;
  /** f_b: p̂ lies on the grid 2^−f_b. */
  readonly linearFractionBits: number;
  /** μ: the linear noise is Poisson(μ) − Poisson(μ) per coordinate, in grid units. */
  readonly poissonMean: number;
}

/** The `two_server` block of a signed study, or null for a one-server study. */
export function twoServerParameters(study: Study): TwoServerParameters | null {
  const block = study.fields["two_server"];
  if (block === undefined || block === null) return null;
  if (typeof block !== "object" || Array.isArray(block)) {
    throw new IpdpError("bad_study", "two_server is not an object");
  }
  const b = block as Record<string, unknown>;
  const text = (name: string): string => {
    if (typeof b[name] !== "string") throw new IpdpError("bad_study", `two_server.${name} is missing`);
    return b[name] as string;
  };
  const integer = (name: string, low: number, high: number): number => {
    const v = b[name];
    if (!Number.isSafeInteger(v) || (v as number) < low || (v as number) > high) {
      throw new IpdpError("bad_study", `two_server.${name} is ${JSON.stringify(v)}, not an ` +
        `integer in [${low}, ${high}]`);
    }
    return v as number;
  };
  const mean = b["poisson_mean"];
  if (typeof mean !== "number" || !(mean >= 0 && Number.isFinite(mean))) {
    throw new IpdpError("bad_study", "two_server.poisson_mean is not a finite number ≥ 0");
  }
  return {
    helperId: text("helper_id"), helperUrl: text("helper_url"), helperKey: text("helper_key"),
    fractionBits: integer("fraction_bits", 0, 62), clampLog2: integer("clamp_log2", -62, 62),
    linearFractionBits: integer("linear_fraction_bits", -1074, 62), poissonMean: mean,
  };
}

/** L = d(d+3)/2 ring elements per record. */
export function entries(d: number): number {
  return (d * (d + 3)) / 2;
}

/** Where each part of a version-3 record of dimension d starts, and its size. */
export function twoServerLayout(d: number) {
  const shareSize = 8 * entries(d);
  const leader = HEADER_SIZE;
  const sealed = leader + shareSize;
  const proofLength = sealed + shareSize + SEAL_OVERHEAD;
  return { entries: entries(d), shareSize, leader, sealed, proofLength,
           size: proofLength + PROOF_LENGTH_SIZE };
}

/** IEEE 754 roundTiesToEven (numpy's rint) of a finite double. */
export function roundHalfEven(x: number): number {
  const r = Math.round(x); // ties go up; r − x is exact for |x| < 2^52, and x is whole beyond
  return r - x === 0.5 && r % 2 !== 0 ? r - 1 : r;
}

/** The ring elements of one record and how many entries the clamp changed. */
export function encodeFixedPoint(
  qTilde: ArrayLike<number>, pHat: ArrayLike<number>, fractionBits: number, clampLog2: number,
): { values: BigUint64Array; clamped: number } {
  const d = qTilde.length;
  if (pHat.length !== d) throw new RangeError(`q̃ has ${d} values but p̂ has ${pHat.length}`);
  const scale = 2 ** fractionBits;
  const limit = 2 ** (clampLog2 + fractionBits);
  const values = new BigUint64Array(entries(d));
  let clamped = 0;
  let at = 0;
  const put = (v: number): void => {
    if (!Number.isFinite(v)) throw new RangeError("q̃ and p̂ must be finite");
    let r = roundHalfEven(v * scale);
    if (Math.abs(r) > limit) {
      clamped++;
      r = Math.sign(r) * limit;
    }
    values[at++] = BigInt.asUintN(64, BigInt(r));
  };
  for (let i = 0; i < d; i++) for (let j = i; j < d; j++) put(qTilde[i]! * qTilde[j]!);
  for (let i = 0; i < d; i++) put(pHat[i]!);
  return { values, clamped };
}

/** L uniform ring elements: 8 little-endian bytes each from `fill` (the CSPRNG by default). */
export function helperShare(count: number, fill: RandomFill = cryptoFill): BigUint64Array {
  const words = new Uint32Array(2 * count);
  fill(words);
  return fromShareBytes(new Uint8Array(words.buffer));
}

/** The leader's share: value − helper mod 2^64, element by element. */
export function leaderShare(values: BigUint64Array, helper: BigUint64Array): BigUint64Array {
  const out = new BigUint64Array(values.length);
  for (let i = 0; i < values.length; i++) out[i] = (values[i]! - helper[i]! + RING) % RING;
  return out;
}

/** A share as its words, little-endian: 8·L bytes. */
export function shareBytes(share: BigUint64Array): Uint8Array<ArrayBuffer> {
  const out = new Uint8Array(8 * share.length);
  const view = new DataView(out.buffer);
  share.forEach((w, i) => view.setBigUint64(8 * i, w, true));
  return out;
}

export function fromShareBytes(bytes: Uint8Array): BigUint64Array {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new BigUint64Array(bytes.byteLength / 8);
  for (let i = 0; i < out.length; i++) out[i] = view.getBigUint64(8 * i, true);
  return out;
}

/** The 48-byte header of a version-3 record. */
export function twoServerHeader(
  studyHash: Uint8Array, recordId: Uint8Array, createdMs: number, d: number,
): Uint8Array<ArrayBuffer> {
  if (studyHash.length !== ID_SIZE) throw new RangeError(`study hash must be ${ID_SIZE} bytes`);
  if (recordId.length !== ID_SIZE) throw new RangeError(`record id must be ${ID_SIZE} bytes`);
  if (!Number.isSafeInteger(createdMs)) throw new RangeError(`created_ms ${createdMs} is not an integer`);
  const out = new Uint8Array(HEADER_SIZE);
  const view = new DataView(out.buffer);
  view.setUint8(0, TWO_SERVER_WIRE_VERSION);
  view.setUint32(4, d, true);
  out.set(studyHash, 8);
  out.set(recordId, 24);
  view.setBigInt64(40, BigInt(createdMs), true);
  return out;
}

const SUITE = new CipherSuite({
  kem: new DhkemX25519HkdfSha256(), kdf: new HkdfSha256(), aead: new Aes128Gcm(),
});

/** The bytes of a view as an ArrayBuffer of their own (a view may sit inside a larger one). */
function own(bytes: Uint8Array): ArrayBuffer {
  return new Uint8Array(bytes).buffer;
}

/** `share` sealed to the helper's raw public key under `header`: enc ‖ ciphertext ‖ tag. */
export async function sealShare(
  helperPublicKey: Uint8Array, share: Uint8Array, header: Uint8Array,
): Promise<Uint8Array<ArrayBuffer>> {
  const recipientPublicKey = await SUITE.kem.importKey("raw", own(helperPublicKey), true);
  const { enc, ct } = await SUITE.seal({ recipientPublicKey, info: own(header) }, own(share));
  const out = new Uint8Array(enc.byteLength + ct.byteLength);
  out.set(new Uint8Array(enc), 0);
  out.set(new Uint8Array(ct), enc.byteLength);
  return out;
}

/** The share {@link sealShare} sealed, opened with the helper's raw private key (the helper's
 * side; the SDK uses it in tests). Rejects when the key or the header is not the one sealed to. */
export async function openShare(
  helperPrivateKey: Uint8Array, sealed: Uint8Array, header: Uint8Array,
): Promise<Uint8Array<ArrayBuffer>> {
  const recipientKey = await SUITE.kem.importKey("raw", own(helperPrivateKey), false);
  const plain = await SUITE.open({ recipientKey, enc: own(sealed.subarray(0, 32)), info: own(header) },
                                 own(sealed.subarray(32)));
  return new Uint8Array(plain);
}

/** header ‖ leader share ‖ sealed helper share ‖ proof length 0. */
export function encodeTwoServerRecord(
  header: Uint8Array, leader: BigUint64Array, sealed: Uint8Array,
): Uint8Array<ArrayBuffer> {
  const d = new DataView(header.buffer, header.byteOffset).getUint32(4, true);
  const layout = twoServerLayout(d);
  if (leader.length !== layout.entries || sealed.length !== layout.shareSize + SEAL_OVERHEAD) {
    throw new RangeError(`a record at d=${d} has ${layout.entries} words per share`);
  }
  const out = new Uint8Array(layout.size);
  out.set(header, 0);
  out.set(shareBytes(leader), layout.leader);
  out.set(sealed, layout.sealed);
  return out; // the proof length stays 0
}

/** The device's grid noise: S = Poisson(μ) − Poisson(μ) per coordinate. */
export type SkellamSource = (count: number, mean: number) => Float64Array;

/** A uniform double in [0, 1) from two CSPRNG words (53 bits). */
function uniform(fill: RandomFill): () => number {
  const words = new Uint32Array(2);
  return () => {
    fill(words);
    return ((words[0]! >>> 5) * 67_108_864 + (words[1]! >>> 6)) / 9_007_199_254_740_992;
  };
}

/** Skellam draws from @stdlib/random-base-poisson (Hörmann's PTRS for μ ≥ 30, the algorithm
 * numpy uses), its uniforms from the CSPRNG: no generator state outlives the call. */
export function skellam(fill: RandomFill = cryptoFill): SkellamSource {
  return (count, mean) => {
    const draw = poisson.factory(mean, { prng: uniform(fill) });
    const out = new Float64Array(count);
    for (let i = 0; i < count; i++) out[i] = draw() - draw();
    return out;
  };
}

/** What a two-server device sends (`bytes`) and, readable, what it encoded: q̃ in `qNoisy`, p̂
 * (on the linear grid) in `pNoisy`. The bytes hold them only as shares. */
export type PreparedTwoServerRecord = PreparedRecord;

export interface TwoServerOverrides {
  /** Fixed (q̃, p̂) instead of perturbing (test vectors). */
  readonly perturbed?: { readonly qTilde: Float64Array; readonly pHat: Float64Array };
  /** Fixed helper share instead of CSPRNG words (test vectors). */
  readonly helperShare?: BigUint64Array;
  readonly recordId?: Uint8Array;
  readonly createdMs?: number;
  readonly fill?: RandomFill;
}

/**
 * Perturb one example for an open two-server study and build its version-3 record
 * (docs/privacy.md, "Two-server mode", Step 9): q̃ = q + u with the study's Gaussian, p̂ on the
 * grid h_b = 2^−f_b as h_b·(rint(p/h_b) − S), then fixed point, shares and the seal.
 */
export async function prepareTwoServerRecord(
  verified: VerifiedStudy, x: ArrayLike<unknown>, y: unknown, overrides: TwoServerOverrides = {},
): Promise<PreparedTwoServerRecord> {
  const { study, studyHash } = requireOpen(verified);
  const two = twoServerParameters(study);
  if (two === null) throw new IpdpError("bad_study", `study ${study.studyId} is not two-server`);
  const fill = overrides.fill ?? cryptoFill;
  let perturbed = overrides.perturbed;
  if (perturbed === undefined) {
    const { q, p } = clipPair(encodeExample(study.loss, x, y, study.d), study.lam, study.pBound);
    const u = gaussian(study.d, study.noise.stdQ, fill);
    const s = skellam(fill)(study.d, two.poissonMean);
    const gridScale = 2 ** two.linearFractionBits;
    perturbed = {
      qTilde: q.map((v, i) => v + u[i]!),
      pHat: p.map((v, i) => (roundHalfEven(v * gridScale) - s[i]!) / gridScale),
    };
  }
  const { values } = encodeFixedPoint(perturbed.qTilde, perturbed.pHat, two.fractionBits,
                                      two.clampLog2);
  const helper = overrides.helperShare ?? helperShare(values.length, fill);
  const recordId = overrides.recordId ?? newRecordId(fill);
  const createdMs = overrides.createdMs ?? Date.now();
  const header = twoServerHeader(studyHash, recordId, createdMs, study.d);
  const sealed = await sealShare(fromBase64(two.helperKey), shareBytes(helper), header);
  return {
    recordId: toHex(recordId),
    createdMs,
    qNoisy: perturbed.qTilde,
    pNoisy: perturbed.pHat,
    bytes: encodeTwoServerRecord(header, leaderShare(values, helper), sealed),
  };
}
