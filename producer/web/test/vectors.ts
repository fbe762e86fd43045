/** producer/web/test-vectors.json, generated from Python by tests/producer/test_web_vectors.py. */

import { readFileSync } from "node:fs";

export interface RecordVector {
  name: string; loss: "squared" | "logistic"; lam: number; p_bound: number; x: number[]; y: number;
  q: number[]; p: number[]; u: number[]; r: number[]; q_noisy: number[]; p_noisy: number[];
  study_hash: string; record_id: string; created_ms: number; record: string;
}

export interface WireVector {
  name: string; study_hash: string; record_id: string; created_ms: number;
  q_noisy: number[]; p_noisy: number[]; record: string;
}

export interface Envelope {
  format: number; study: string; status: string; key_id: string; signature: string;
}

export interface StudyVector {
  name: string; envelope: Envelope; signed_message: string; study_hash: string;
}

export interface CredentialVector {
  envelope: Envelope; study_hash: string; issuer_public_key: string; credential: string;
  credential_id: string; issued_ms: number; expires_ms: number; records_per_device: number;
  slot_record_ids: string[];
}

export interface SchemaVector {
  envelope: Envelope;
  rows: { row: Record<string, number | string>; x: number[]; y: number; clipped: string[] }[];
}

export interface TwoServerCase {
  name: string; d: number; fraction_bits: number; clamp_log2: number; study_hash: string;
  record_id: string; created_ms: number; q_tilde: number[]; p_hat: number[]; values: string[];
  clamped: number; helper_share: string; header: string; leader_share: string; unsealed: string;
  /** The whole version-3 record, its helper share sealed by Python. */
  record: string;
}

export interface Vectors {
  keys: { owner_public_key: string; owner_key_id: string; stranger_public_key: string };
  studies: StudyVector[];
  records: RecordVector[];
  wire: WireVector[];
  credentials: CredentialVector;
  /** A version-2 credential: leaf 2 of a batch of four under one signature. */
  batch_credential: CredentialVector;
  /** Studies with a schema, and raw rows with what Python encodes them to. */
  schemas: SchemaVector[];
  /** A signed two-server study and version-3 records for fixed inputs and helper shares. */
  two_server: {
    envelope: Envelope; study_hash: string; helper_private_key: string; helper_public_key: string;
    cases: TwoServerCase[];
  };
}

// Compiled to .test-build/test/, two levels below producer/web/.
export const vectors: Vectors = JSON.parse(
  readFileSync(new URL("../../test-vectors.json", import.meta.url), "utf8"));

export const openStudy = vectors.studies.find((s) => s.envelope.status === "open")!;
export const closedStudy = vectors.studies.find((s) => s.envelope.status === "closed")!;

/** Same doubles, bit for bit: Object.is tells −0 from +0. */
export function sameDoubles(actual: ArrayLike<number>, expected: ArrayLike<number>): boolean {
  if (actual.length !== expected.length) return false;
  for (let i = 0; i < actual.length; i++) if (!Object.is(actual[i], expected[i])) return false;
  return true;
}
