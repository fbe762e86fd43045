/**
 * The signed study envelope (format 2): verify it against the pinned keys, then read the study.
 *
 * Nothing in the study text is read before its signature verifies. The signature covers
 * `"ipdp-study-v2\n" + status + "\n" + study`, so neither the parameters (noise included) nor the
 * open/closed status can be altered without the device noticing. The wire's study hash is
 * SHA-256 of the exact study text received, truncated to 16 bytes: the device never
 * re-canonicalises JSON.
 */

import { fromBase64, toHex, utf8 } from "./bytes.js";
import { IpdpError } from "./errors.js";
import { type Loss, parseSchema, type Schema } from "./schema.js";

export const ENVELOPE_FORMAT = 2;
export const SIGNATURE_CONTEXT = "ipdp-study-v2";

export type { Loss };
export type StudyStatus = "open" | "closed";

/** The public parameters a device uses, read from the signed study text. */
export interface Study {
  readonly studyId: string;
  readonly loss: Loss;
  /** Dimension of x, q and p. */
  readonly d: number;
  /** Records per round: each model is trained from exactly n of them. */
  readonly n: number;
  /** Central (ε, δ) of each published model. */
  readonly epsilon: number;
  readonly delta: number;
  /** λ: the device clips ‖q‖² ≤ λ. */
  readonly lam: number;
  /** P: the device clips ‖p‖ ≤ P. */
  readonly pBound: number;
  /** Calibration mode, "rigorous" (the default) or "paper". */
  readonly mode: string;
  readonly maxRounds: number | null;
  /** Whether the gateway admits records only with a device credential (see credential.ts). */
  readonly requireCredentials: boolean;
  /** Records one credential may contribute: its slots 0 … recordsPerDevice − 1. */
  readonly recordsPerDevice: number;
  /** The named features and target of a raw row with their public ranges (schema.ts), or null
   * for a study whose devices send an encoded (x, y). */
  readonly schema: Schema | null;
  /** Per-coordinate noise stds: u ~ N(0, stdQ² I) on q, r ~ N(0, stdP² I) on p. */
  readonly noise: { readonly stdQ: number; readonly stdP: number };
  /** Every field of the signed study text, including ones this SDK version does not know. */
  readonly fields: Readonly<Record<string, unknown>>;
}

export interface VerifiedStudy {
  readonly study: Study;
  /** The study text exactly as signed and received. */
  readonly studyText: string;
  readonly status: StudyStatus;
  /** Hex id of the pinned key that verified the signature. */
  readonly keyId: string;
  /** The 16-byte study hash every record of this study carries on the wire. */
  readonly studyHash: Uint8Array;
}

export interface TrustedKey {
  /** Hex of SHA-256(raw public key)[:8], the envelope's `key_id`. */
  readonly keyId: string;
  readonly key: CryptoKey;
}

/** Import a pinned key: one line of a `.pub` file, standard base64 of the raw 32-byte key. */
export async function importTrustedKey(publicKeyBase64: string): Promise<TrustedKey> {
  let raw: Uint8Array<ArrayBuffer>;
  try {
    raw = fromBase64(publicKeyBase64.trim());
  } catch {
    throw new IpdpError("bad_key", "the pinned public key is not standard padded base64");
  }
  if (raw.length !== 32) {
    throw new IpdpError("bad_key", `the pinned public key has ${raw.length} bytes, Ed25519 has 32`);
  }
  const subtle = webCrypto();
  let key: CryptoKey;
  try {
    key = await subtle.importKey("raw", raw, { name: "Ed25519" }, false, ["verify"]);
  } catch (cause) {
    throw new IpdpError(
      "unsupported_runtime",
      "this browser's WebCrypto cannot import Ed25519 keys (needs Chrome 137, Firefox 129, " +
        "Safari 17 or Node 20 and later)",
      { cause },
    );
  }
  const digest = new Uint8Array(await subtle.digest("SHA-256", raw));
  return { keyId: toHex(digest.subarray(0, 8)), key };
}

/** The bytes the study owner signs. */
export function signedMessage(status: string, studyText: string): Uint8Array<ArrayBuffer> {
  return utf8(`${SIGNATURE_CONTEXT}\n${status}\n${studyText}`);
}

/** SHA-256 of the UTF-8 study text, first 16 bytes: the wire format's `study_hash`. */
export async function studyHash(studyText: string): Promise<Uint8Array> {
  const digest = await webCrypto().digest("SHA-256", utf8(studyText));
  return new Uint8Array(digest, 0, 16);
}

/**
 * Verify a format-2 envelope (parsed JSON or its text) against the pinned keys and read its study.
 * Closed studies verify too (a page may show them); {@link requireOpen} refuses them.
 */
export async function verifyStudyEnvelope(
  envelope: unknown,
  trusted: TrustedKey | readonly TrustedKey[],
): Promise<VerifiedStudy> {
  const env = typeof envelope === "string" ? parseJson(envelope, "the study envelope") : envelope;
  if (!isObject(env)) throw new IpdpError("bad_study", "the study envelope is not a JSON object");
  if (env["format"] !== ENVELOPE_FORMAT) {
    throw new IpdpError(
      "bad_study",
      `envelope format ${JSON.stringify(env["format"])}; this SDK reads format ${ENVELOPE_FORMAT}`,
    );
  }
  const studyText = env["study"];
  const status = env["status"];
  const keyId = env["key_id"];
  const signature = env["signature"];
  if (typeof studyText !== "string" || typeof status !== "string" ||
      typeof keyId !== "string" || typeof signature !== "string") {
    throw new IpdpError(
      "bad_study", "the envelope needs the strings study, status, key_id and signature");
  }
  const keys: readonly TrustedKey[] = Array.isArray(trusted) ? trusted : [trusted as TrustedKey];
  const signer = keys.find((k) => k.keyId === keyId);
  if (signer === undefined) {
    throw new IpdpError(
      "bad_signature",
      `the study is signed with key ${keyId}, which is not pinned here ` +
        `(pinned: ${keys.map((k) => k.keyId).join(", ") || "none"})`,
    );
  }
  let sig: Uint8Array<ArrayBuffer>;
  try {
    sig = fromBase64(signature);
  } catch {
    throw new IpdpError("bad_signature", "the study signature is not standard padded base64");
  }
  if (sig.length !== 64) {
    throw new IpdpError("bad_signature", `the study signature has ${sig.length} bytes, Ed25519 has 64`);
  }
  const message = signedMessage(status, studyText);
  if (!await webCrypto().verify({ name: "Ed25519" }, signer.key, sig, message)) {
    throw new IpdpError(
      "bad_signature",
      `the study signature does not verify with pinned key ${keyId}: the study text or its ` +
        "status is not what the owner signed",
    );
  }
  if (status !== "open" && status !== "closed") {
    throw new IpdpError("bad_study", `study status ${JSON.stringify(status)} is neither open nor closed`);
  }
  return {
    study: parseStudyText(studyText),
    studyText,
    status,
    keyId,
    studyHash: await studyHash(studyText),
  };
}

/** Refuse a closed study: it accepts no more records. */
export function requireOpen(verified: VerifiedStudy): VerifiedStudy {
  if (verified.status !== "open") {
    throw new IpdpError(
      "closed_study", `study ${verified.study.studyId} is closed and accepts no more records`);
  }
  return verified;
}

/** Read the device's parameters from a study text; unknown fields are kept, not refused. */
export function parseStudyText(studyText: string): Study {
  const fields = parseJson(studyText, "the study text");
  if (!isObject(fields)) throw new IpdpError("bad_study", "the study text is not a JSON object");
  const studyId = fields["study_id"];
  if (typeof studyId !== "string" || studyId === "") {
    throw new IpdpError("bad_study", "the study has no study_id");
  }
  const loss = fields["loss"];
  if (loss !== "squared" && loss !== "logistic") {
    throw new IpdpError(
      "bad_study", `loss ${JSON.stringify(loss)} is not one this SDK encodes (squared, logistic)`);
  }
  const noise = fields["noise"];
  if (!isObject(noise)) {
    throw new IpdpError("bad_study", "the study carries no noise object {std_q, std_p}");
  }
  const mode = fields["mode"];
  const maxRounds = fields["max_rounds"] ?? null;
  if (maxRounds !== null && !(Number.isSafeInteger(maxRounds) && (maxRounds as number) >= 1)) {
    throw new IpdpError("bad_study", `max_rounds ${JSON.stringify(maxRounds)} is not an integer ≥ 1`);
  }
  const requireCredentials = fields["require_credentials"] ?? false;
  if (typeof requireCredentials !== "boolean") {
    throw new IpdpError("bad_study", `require_credentials ${JSON.stringify(requireCredentials)} ` +
      "is not a boolean");
  }
  const d = positiveInteger(fields, "d");
  return {
    studyId,
    loss,
    requireCredentials,
    schema: "schema" in fields ? parseSchema(fields["schema"], d, loss) : null,
    recordsPerDevice: "records_per_device" in fields
      ? positiveInteger(fields, "records_per_device") : 1,
    d,
    n: positiveInteger(fields, "n"),
    epsilon: positiveNumber(fields, "epsilon"),
    delta: positiveNumber(fields, "delta"),
    lam: positiveNumber(fields, "lam"),
    pBound: positiveNumber(fields, "p_bound"),
    mode: typeof mode === "string" ? mode : "unstated",
    maxRounds: maxRounds as number | null,
    noise: { stdQ: positiveNumber(noise, "std_q"), stdP: positiveNumber(noise, "std_p") },
    fields,
  };
}

function positiveNumber(obj: Record<string, unknown>, name: string): number {
  const v = obj[name];
  if (typeof v !== "number" || !Number.isFinite(v) || v <= 0) {
    throw new IpdpError("bad_study", `${name} is ${JSON.stringify(v)}, not a finite number > 0`);
  }
  return v;
}

function positiveInteger(obj: Record<string, unknown>, name: string): number {
  const v = obj[name];
  if (!Number.isSafeInteger(v) || (v as number) < 1) {
    throw new IpdpError("bad_study", `${name} is ${JSON.stringify(v)}, not an integer ≥ 1`);
  }
  return v as number;
}

function parseJson(text: string, what: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    throw new IpdpError("bad_study", `${what} is not valid JSON`);
  }
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

export function webCrypto(): SubtleCrypto {
  const subtle = globalThis.crypto?.subtle;
  if (subtle === undefined) {
    throw new IpdpError(
      "unsupported_runtime", "WebCrypto (crypto.subtle) is missing; pages need a secure context");
  }
  return subtle;
}
