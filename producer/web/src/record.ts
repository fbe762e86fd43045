/**
 * Everything a device does before a record leaves it: encode → clip → add noise → wire-encode.
 * The raw (x, y) stay in this function's arguments; a PreparedRecord holds only what is sent.
 */

import { toHex } from "./bytes.js";
import { addNoise, clipPair, encodeExample, type QuadraticPair } from "./encode.js";
import { cryptoFill, drawNoise, type Noise, type RandomFill } from "./noise.js";
import { requireOpen, type Study, type VerifiedStudy } from "./study.js";
import { IpdpError } from "./errors.js";
import { encodeRecord, ID_SIZE } from "./wire.js";

/** The study parameters encoding and clipping use. */
export type EncodingParameters = Pick<Study, "loss" | "d" | "lam" | "pBound">;

/** What leaves the device: exactly `bytes`; the other fields are those bytes, readable. */
export interface PreparedRecord {
  /** The 16-byte record id, hex. */
  readonly recordId: string;
  readonly createdMs: number;
  readonly qNoisy: Float64Array;
  readonly pNoisy: Float64Array;
  readonly bytes: Uint8Array;
}

export interface RecordOverrides {
  /** Fixed noise instead of a fresh draw (test vectors). */
  readonly noise?: Noise;
  /** Fixed 16-byte record id instead of a random one. */
  readonly recordId?: Uint8Array;
  /** Fixed creation time instead of Date.now(). */
  readonly createdMs?: number;
  /** Random source for noise and id; the platform CSPRNG unless a test passes its own. */
  readonly fill?: RandomFill;
}

/** (q̃, p̃) for one example under explicitly given noise. */
export function perturbWithNoise(
  params: EncodingParameters,
  x: ArrayLike<unknown>,
  y: unknown,
  noise: Noise,
): QuadraticPair {
  const pair = encodeExample(params.loss, x, y, params.d);
  return addNoise(clipPair(pair, params.lam, params.pBound), noise);
}

/** (q̃, p̃) for one example, with noise drawn from the platform CSPRNG at the study's stds. */
export function perturb(
  params: EncodingParameters & Pick<Study, "noise">,
  x: ArrayLike<unknown>,
  y: unknown,
  fill: RandomFill = cryptoFill,
): QuadraticPair {
  const pair = clipPair(encodeExample(params.loss, x, y, params.d), params.lam, params.pBound);
  return addNoise(pair, drawNoise(params.d, params.noise, fill));
}

/** 16 random bytes shaped like a UUID version 4 (as producer/contributor.py new_record_ids). */
export function newRecordId(fill: RandomFill = cryptoFill): Uint8Array {
  const words = new Uint32Array(ID_SIZE / 4);
  fill(words);
  const id = new Uint8Array(words.buffer);
  id[6] = (id[6]! & 0x0f) | 0x40;
  id[8] = (id[8]! & 0x3f) | 0x80;
  return id;
}

/** Perturb one example for an open, verified study and encode the record to send. */
export function prepareRecord(
  verified: VerifiedStudy,
  x: ArrayLike<unknown>,
  y: unknown,
  overrides: RecordOverrides = {},
): PreparedRecord {
  const { study, studyHash } = requireOpen(verified);
  if (study.fields["two_server"] !== undefined && study.fields["two_server"] !== null) {
    throw new IpdpError("bad_study", `study ${study.studyId} is two-server: its records are ` +
      "version 3 (prepareTwoServerRecord), not version 1");
  }
  const fill = overrides.fill ?? cryptoFill;
  const { q, p } = overrides.noise === undefined
    ? perturb(study, x, y, fill)
    : perturbWithNoise(study, x, y, overrides.noise);
  const recordId = overrides.recordId ?? newRecordId(fill);
  const createdMs = overrides.createdMs ?? Date.now();
  return {
    recordId: toHex(recordId),
    createdMs,
    qNoisy: q,
    pNoisy: p,
    bytes: encodeRecord(studyHash, recordId, createdMs, q, p),
  };
}
