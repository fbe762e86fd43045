/** ipdp's browser contributor. See producer/web/README.md. */

export { contribute, fetchStudy, sendRecord, sendRecords, studyUrl } from "./client.js";
export type { Contribution, CredentialSlot, GatewayOptions, PinnedKeys } from "./client.js";
export {
  AUTH_SCHEME, credentialRecordId, parseCredential, slotRecordId,
} from "./credential.js";
export type { Credential } from "./credential.js";
export { addNoise, clipPair, clipRow, encodeExample, norm } from "./encode.js";
export type { QuadraticPair } from "./encode.js";
export { IpdpError } from "./errors.js";
export type { FailureReason } from "./errors.js";
export { cryptoFill, drawNoise, gaussian } from "./noise.js";
export type { Noise, RandomFill } from "./noise.js";
export { newRecordId, perturb, perturbWithNoise, prepareRecord } from "./record.js";
export type { EncodingParameters, PreparedRecord, RecordOverrides } from "./record.js";
export {
  ENVELOPE_FORMAT, importTrustedKey, parseStudyText, requireOpen, SIGNATURE_CONTEXT, signedMessage,
  studyHash, verifyStudyEnvelope,
} from "./study.js";
export type { Loss, Study, StudyStatus, TrustedKey, VerifiedStudy } from "./study.js";
export { privacyReport } from "./report.js";
export { encodeRow, parseSchema, schemaDimension } from "./schema.js";
export type { EncodedRow, RawRow, Schema, SchemaFeature, SchemaTarget } from "./schema.js";
export { encodeRecord, HEADER_SIZE, ID_SIZE, recordSize, WIRE_VERSION } from "./wire.js";
export { fromHex, toHex } from "./bytes.js";
