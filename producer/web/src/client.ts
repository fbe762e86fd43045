/**
 * Talk to the ipdp gateway: `GET /studies/{id}` for the signed study, `POST /studies/{id}/records`
 * with the device's one v1 record (`contribute`, `sendRecord`), or several concatenated for a
 * batch uploader (`sendRecords`); the gateway's group commit makes one record per request cheap.
 * A refusal becomes an IpdpError carrying the gateway's machine reason; retryable failures (5xx,
 * 429, network) are retried with the same bytes, which the record id makes harmless (a duplicate
 * is dead-lettered as `replayed`, never folded twice), after the answer's `Retry-After` plus a
 * random share of it, so devices refused together do not come back together.
 */

import { concatBytes } from "./bytes.js";
import { AUTH_SCHEME, credentialRecordId } from "./credential.js";
import { IpdpError, type FailureReason } from "./errors.js";
import { prepareRecord, type PreparedRecord, type RecordOverrides } from "./record.js";
import {
  importTrustedKey, requireOpen, verifyStudyEnvelope, type TrustedKey, type VerifiedStudy,
} from "./study.js";

export interface GatewayOptions {
  /** The device's credential (the line its issuer gave it), for a study that requires one. */
  readonly credential?: string;
  /** The fetch to use; the global one by default. */
  readonly fetch?: typeof fetch;
  /** Further attempts after a retryable failure; 7 by default, 0 turns retrying off. */
  readonly retries?: number;
  /**
   * Wait before the first retry in ms, doubled for each next one, when the answer has no
   * `Retry-After` (which wins, capped at 30 s); 500 by default.
   */
  readonly retryDelayMs?: number;
  /** Each wait is stretched by a random factor in [1, 1 + jitter); 0.5 by default. */
  readonly retryJitter?: number;
  readonly signal?: AbortSignal;
}

/** Pinned keys: `.pub` lines (base64 of the raw key) or keys already imported. */
export type PinnedKeys = string | TrustedKey | readonly (string | TrustedKey)[];

export interface Contribution {
  /** Hex of the 16-byte record id. */
  readonly recordId: string;
  /** The record as sent: its bytes and the q̃, p̃ (or, two-server, q̃, p̂) they encode. */
  readonly record: PreparedRecord;
  readonly study: VerifiedStudy;
}

/** Gateway reasons that mean the same as a device-side reason. */
const SHARED_REASONS: ReadonlySet<string> = new Set<FailureReason>(
  ["unknown_study", "closed_study", "wrong_dimension"]);
/** Longest wait a gateway's Retry-After may ask for before the SDK gives up waiting. */
const MAX_RETRY_AFTER_MS = 30_000;

export interface CredentialSlot {
  /**
   * Which of the credential's slots this record uses (0 by default): a study that requires
   * credentials folds one record per slot, so a device sending several records numbers them.
   */
  readonly slot?: number;
}

/**
 * Contribute one example: fetch and verify the study, refuse it if closed, perturb (x, y) on the
 * device, send the record. Resolves once the gateway has accepted it (Kafka acknowledged).
 * A study that requires credentials needs `options.credential`; the record id is then the
 * credential's slot `options.slot` (0 by default).
 */
export async function contribute(
  gatewayUrl: string,
  studyId: string,
  pinnedKeys: PinnedKeys,
  x: ArrayLike<unknown>,
  y: unknown,
  options: GatewayOptions & RecordOverrides & CredentialSlot = {},
): Promise<Contribution> {
  const study = requireOpen(await fetchStudy(gatewayUrl, studyId, pinnedKeys, options));
  let overrides: RecordOverrides = options;
  if (study.study.requireCredentials) {
    if (options.credential === undefined) {
      throw new IpdpError(
        "credential_required", `study ${studyId} requires a device credential from its issuer`);
    }
    // The record's creation time is the device's "now" (fixed only by tests).
    overrides = { ...options, recordId: await credentialRecordId(
      study, options.credential, options.slot ?? 0, options.createdMs ?? Date.now()) };
  }
  // A two-server study's record is version 3: fixed point, shares, the helper's sealed. Its
  // module (and its dependencies, @hpke/core and @stdlib/random-base-poisson) loads only then.
  const twoServer = study.study.fields["two_server"] ?? null;
  const record = twoServer === null
    ? prepareRecord(study, x, y, overrides)
    : await (await import("./two-server.js")).prepareTwoServerRecord(study, x, y, {
      ...(overrides.recordId === undefined ? {} : { recordId: overrides.recordId }),
      ...(overrides.createdMs === undefined ? {} : { createdMs: overrides.createdMs }),
      ...(overrides.fill === undefined ? {} : { fill: overrides.fill }),
    });
  await sendRecord(gatewayUrl, studyId, record.bytes, options);
  return { recordId: record.recordId, record, study };
}

/** `POST /studies/{id}/records` with one device's record; resolves to 1 once it is accepted. */
export async function sendRecord(
  gatewayUrl: string,
  studyId: string,
  record: Uint8Array,
  options: GatewayOptions = {},
): Promise<number> {
  return sendRecords(gatewayUrl, studyId, [record], options);
}

/** `GET /studies/{id}`, verified against the pinned keys; open and closed studies resolve. */
export async function fetchStudy(
  gatewayUrl: string,
  studyId: string,
  pinnedKeys: PinnedKeys,
  options: GatewayOptions = {},
): Promise<VerifiedStudy> {
  const keys = await Promise.all(
    (Array.isArray(pinnedKeys) ? pinnedKeys : [pinnedKeys as string | TrustedKey]).map(
      (k) => (typeof k === "string" ? importTrustedKey(k) : k)));
  const response = await request(studyUrl(gatewayUrl, studyId), {
    method: "GET", headers: { accept: "application/json" }, cache: "no-store",
  }, options);
  let envelope: unknown;
  try {
    envelope = await response.json();
  } catch (cause) {
    throw new IpdpError("bad_study", "the gateway's study answer is not JSON", { cause });
  }
  const verified = await verifyStudyEnvelope(envelope, keys);
  if (verified.study.studyId !== studyId) {
    throw new IpdpError(
      "bad_study", `asked for study ${studyId} but the gateway sent ${verified.study.studyId}`);
  }
  return verified;
}

/**
 * `POST /studies/{id}/records` with the records concatenated, for a batch uploader holding many
 * devices' records; resolves to how many were accepted.
 */
export async function sendRecords(
  gatewayUrl: string,
  studyId: string,
  records: readonly Uint8Array[],
  options: GatewayOptions = {},
): Promise<number> {
  if (records.length === 0) return 0;
  if (records.some((r) => r.length !== records[0]!.length)) {
    throw new RangeError("records sent together must all have the same dimension");
  }
  const response = await request(studyUrl(gatewayUrl, studyId, "records"), {
    method: "POST",
    headers: {
      "content-type": "application/octet-stream", accept: "application/json",
      ...(options.credential === undefined
        ? {} : { authorization: `${AUTH_SCHEME} ${options.credential.trim()}` }),
    },
    body: concatBytes(records),
  }, options);
  const answer: unknown = await response.json().catch(() => undefined);
  const accepted = (answer as { accepted?: unknown } | undefined)?.accepted;
  if (accepted !== records.length) {
    throw new IpdpError(
      "gateway_refused",
      `the gateway answered ${response.status} accepting ${JSON.stringify(accepted)} of ` +
        `${records.length} records`,
      { status: response.status, gatewayReason: "partial_accept" },
    );
  }
  return accepted;
}

/** `{gateway}/studies/{id}[/suffix]`; a gateway mounted under a path prefix works too. */
export function studyUrl(gatewayUrl: string, studyId: string, suffix?: string): string {
  const base = new URL(gatewayUrl, globalThis.location?.href);
  if (!base.pathname.endsWith("/")) base.pathname += "/";
  const path = `studies/${encodeURIComponent(studyId)}${suffix === undefined ? "" : `/${suffix}`}`;
  return new URL(path, base).href;
}

/** fetch with the retry policy; resolves to a 2xx response, throws an IpdpError otherwise. */
async function request(url: string, init: RequestInit, options: GatewayOptions): Promise<Response> {
  const doFetch = options.fetch ?? globalThis.fetch;
  const retries = options.retries ?? 7;
  const jitter = options.retryJitter ?? 0.5;
  let delayMs = options.retryDelayMs ?? 500;
  for (let attempt = 0; ; attempt++) {
    let error: IpdpError;
    let waitMs = delayMs;
    try {
      const response = await doFetch(url, { ...init, ...(options.signal ? { signal: options.signal } : {}) });
      if (response.ok) return response;
      error = await refusal(response);
      waitMs = retryAfterMs(response) ?? delayMs;
    } catch (cause) {
      if (cause instanceof IpdpError || options.signal?.aborted) throw cause;
      error = new IpdpError(
        "gateway_unreachable", `${init.method} ${url} failed: ${String(cause)}`,
        { retryable: true, cause });
    }
    if (!error.retryable || attempt >= retries) throw error;
    await new Promise((resolve) => setTimeout(resolve, waitMs * (1 + jitter * Math.random())));
    delayMs *= 2;
  }
}

async function refusal(response: Response): Promise<IpdpError> {
  const body: unknown = await response.json().catch(() => undefined);
  const { error, detail } = (body ?? {}) as { error?: unknown; detail?: unknown };
  const gatewayReason = typeof error === "string" ? error : `http_${response.status}`;
  const reason = SHARED_REASONS.has(gatewayReason) ? gatewayReason as FailureReason : "gateway_refused";
  const text = typeof detail === "string" ? detail : response.statusText;
  return new IpdpError(reason, `the gateway answered ${response.status} ${gatewayReason}: ${text}`, {
    status: response.status,
    gatewayReason,
    retryable: response.status >= 500 || response.status === 429,
  });
}

function retryAfterMs(response: Response): number | undefined {
  const seconds = Number(response.headers.get("retry-after") ?? NaN);
  return Number.isFinite(seconds) && seconds >= 0
    ? Math.min(seconds * 1000, MAX_RETRY_AFTER_MS)
    : undefined;
}
