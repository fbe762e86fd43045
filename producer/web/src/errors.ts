/**
 * The one error type of the SDK. `reason` says which failure it is, in the same words the
 * gateway and the aggregator use where they share one (`unknown_study`, `closed_study`,
 * `wrong_dimension`); `detail` says what exactly was wrong, for a person.
 */

export type FailureReason =
  /** The gateway has no study with this id. */
  | "unknown_study"
  /** The study is closed and accepts no more records. */
  | "closed_study"
  /** The study is not signed by a pinned key, or its signature does not verify. */
  | "bad_signature"
  /** The envelope or the signed study text is not what this SDK understands. */
  | "bad_study"
  /** A pinned public key is not standard base64 of 32 bytes. */
  | "bad_key"
  /** x does not have the study's dimension d (said by the device, or by the gateway). */
  | "wrong_dimension"
  /** x or y is not a finite number, or a logistic label is not −1 or +1. */
  | "invalid_example"
  /** This runtime lacks what the SDK needs (WebCrypto Ed25519, crypto.getRandomValues). */
  | "unsupported_runtime"
  /** The study requires a device credential and none was given. */
  | "credential_required"
  /** The credential is malformed, for another study, expired, or has no such slot. */
  | "bad_credential"
  /** The gateway refused the request for another reason; `gatewayReason` names it. */
  | "gateway_refused"
  /** The gateway could not be reached, or its answer could not be read. */
  | "gateway_unreachable";

export interface GatewayFacts {
  /** HTTP status of the gateway's answer. */
  readonly status?: number;
  /** The gateway's machine reason (its JSON `error` field), e.g. `rate_limited`. */
  readonly gatewayReason?: string;
  /** True when sending the same bytes again may succeed (5xx, 429, network). */
  readonly retryable?: boolean;
  readonly cause?: unknown;
}

export class IpdpError extends Error {
  override readonly name = "IpdpError";
  readonly reason: FailureReason;
  readonly detail: string;
  readonly status: number | undefined;
  readonly gatewayReason: string | undefined;
  readonly retryable: boolean;

  constructor(reason: FailureReason, detail: string, facts: GatewayFacts = {}) {
    super(`${reason}: ${detail}`, facts.cause === undefined ? undefined : { cause: facts.cause });
    this.reason = reason;
    this.detail = detail;
    this.status = facts.status;
    this.gatewayReason = facts.gatewayReason;
    this.retryable = facts.retryable ?? false;
  }
}
