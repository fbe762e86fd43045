/**
 * Wire format version 1 (docs/wire-format.md), byte-identical to ipdp.wire.encode_record:
 * a 48-byte little-endian header, then q̃ and p̃ as d float64 each.
 */

export const WIRE_VERSION = 1;
export const HEADER_SIZE = 48;
export const ID_SIZE = 16;

/** Bytes of one record of dimension d: 48 + 16·d. */
export function recordSize(d: number): number {
  if (!Number.isSafeInteger(d) || d < 1) throw new RangeError(`d must be an integer ≥ 1, got ${d}`);
  return HEADER_SIZE + 16 * d;
}

/** Encode one record; q̃ and p̃ must be finite (the aggregator dead-letters anything else). */
export function encodeRecord(
  studyHash: Uint8Array,
  recordId: Uint8Array,
  createdMs: number,
  qNoisy: Float64Array,
  pNoisy: Float64Array,
): Uint8Array<ArrayBuffer> {
  if (studyHash.length !== ID_SIZE) throw new RangeError(`study hash must be ${ID_SIZE} bytes`);
  if (recordId.length !== ID_SIZE) throw new RangeError(`record id must be ${ID_SIZE} bytes`);
  if (!Number.isSafeInteger(createdMs)) throw new RangeError(`created_ms ${createdMs} is not an integer`);
  const d = qNoisy.length;
  if (pNoisy.length !== d) throw new RangeError(`q̃ has ${d} values but p̃ has ${pNoisy.length}`);
  const out = new Uint8Array(recordSize(d));
  const view = new DataView(out.buffer);
  view.setUint8(0, WIRE_VERSION);
  view.setUint32(4, d, true);
  out.set(studyHash, 8);
  out.set(recordId, 24);
  view.setBigInt64(40, BigInt(createdMs), true);
  for (let i = 0; i < d; i++) {
    const q = qNoisy[i]!;
    const p = pNoisy[i]!;
    if (!Number.isFinite(q) || !Number.isFinite(p)) throw new RangeError("q̃ and p̃ must be finite");
    view.setFloat64(HEADER_SIZE + 8 * i, q, true);
    view.setFloat64(HEADER_SIZE + 8 * (d + i), p, true);
  }
  return out;
}
