/**
 * Device credentials (docs/wire-format.md, "Device credentials"): a study that requires them
 * admits a device's records only with the credential its issuer gave it, sent as
 * `Authorization: IPDP-Credential <credential>`, and only in the credential's slots: record ids
 * SHA-256("ipdp-record-id-v1\n" ‖ credential id ‖ u32le(slot))[:16], slot < recordsPerDevice.
 *
 * The device does not verify the issuer's signature (the gateway and the aggregator do, against
 * the issuer key they pin); it reads the fields to use the right slots and to refuse early a
 * credential that cannot work.
 */

import { concatBytes, toHex, utf8 } from "./bytes.js";
import { IpdpError } from "./errors.js";
import { webCrypto, type VerifiedStudy } from "./study.js";

export const AUTH_SCHEME = "IPDP-Credential";
/** Version 1: one signature per credential, 121 bytes. */
const TOKEN_SIZE = 121;
/** Version 2: one of a batch under one signature, 158 + 32 × height bytes (height: byte 41). */
const BATCH_PATH_AT = 158;
const MAX_TREE_HEIGHT = 20;
const BASE64URL = /^[A-Za-z0-9_-]*$/;

export interface Credential {
  /** The text form, as the issuer printed it (unpadded base64url). */
  readonly text: string;
  readonly studyHash: Uint8Array;
  readonly credentialId: Uint8Array;
  readonly issuedMs: number;
  readonly expiresMs: number;
}

/** Where each version's token holds the fields a device reads (docs/wire-format.md). */
const LAYOUTS = {
  1: { credentialId: 17, issuedMs: 33, expiresMs: 41 },
  2: { credentialId: 142, issuedMs: 17, expiresMs: 25 },
} as const;

/** Read a credential's fields (not its signature: the gateway checks that). */
export function parseCredential(text: string): Credential {
  const trimmed = text.trim();
  if (!BASE64URL.test(trimmed)) {
    throw new IpdpError("bad_credential", "the credential is not unpadded base64url");
  }
  const binary = atob(trimmed.replace(/-/g, "+").replace(/_/g, "/") +
    "=".repeat((4 - (trimmed.length % 4)) % 4));
  const raw = Uint8Array.from(binary, (c) => c.charCodeAt(0));
  const height = raw[41] ?? Infinity;
  const layout =
    raw[0] === 1 && raw.length === TOKEN_SIZE ? LAYOUTS[1]
    : raw[0] === 2 && height <= MAX_TREE_HEIGHT && raw.length === BATCH_PATH_AT + 32 * height
      ? LAYOUTS[2] : undefined;
  if (layout !== undefined) {
    const view = new DataView(raw.buffer);
    return {
      text: trimmed,
      studyHash: raw.slice(1, 17),
      credentialId: raw.slice(layout.credentialId, layout.credentialId + 16),
      issuedMs: Number(view.getBigInt64(layout.issuedMs, true)),
      expiresMs: Number(view.getBigInt64(layout.expiresMs, true)),
    };
  }
  throw new IpdpError(
    "bad_credential", `the credential has ${raw.length} bytes and version ${raw[0]}; version 1 ` +
      `has ${TOKEN_SIZE}, version 2 ${BATCH_PATH_AT} + 32 × its height (at most ${MAX_TREE_HEIGHT})`);
}

/** The record id of slot `slot` of a credential. */
export async function slotRecordId(credentialId: Uint8Array, slot: number): Promise<Uint8Array> {
  const index = new Uint8Array(4);
  new DataView(index.buffer).setUint32(0, slot, true);
  const message = concatBytes([utf8("ipdp-record-id-v1\n"), credentialId, index]);
  return new Uint8Array(await webCrypto().digest("SHA-256", message), 0, 16);
}

/**
 * The record id to use for slot `slot` of `credentialText` in a verified study; refuses a
 * credential that is for another study, expired at `nowMs`, or has no such slot.
 */
export async function credentialRecordId(
  verified: VerifiedStudy,
  credentialText: string,
  slot: number,
  nowMs: number = Date.now(),
): Promise<Uint8Array> {
  const credential = parseCredential(credentialText);
  if (toHex(credential.studyHash) !== toHex(verified.studyHash)) {
    throw new IpdpError(
      "bad_credential", `the credential is for study hash ${toHex(credential.studyHash)}, not ` +
        `${verified.study.studyId}'s`);
  }
  if (nowMs > credential.expiresMs) {
    throw new IpdpError("bad_credential", `the credential expired at ${credential.expiresMs} ms`);
  }
  const slots = verified.study.recordsPerDevice;
  if (!(Number.isSafeInteger(slot) && slot >= 0 && slot < slots)) {
    throw new IpdpError(
      "bad_credential", `slot ${slot}: a credential of study ${verified.study.studyId} has ` +
        `slots 0 … ${slots - 1}`);
  }
  return slotRecordId(credential.credentialId, slot);
}
