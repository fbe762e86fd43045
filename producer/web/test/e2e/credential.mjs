// The browser SDK's credential path against a real gateway, in Node (fetch and WebCrypto as in a
// browser): contribute with a credential in slot 0 and slot 1, slot 0 again, and without one.
//
//   node test/e2e/credential.mjs GATEWAY_URL STUDY_ID OWNER_PUBLIC_KEY CREDENTIAL
//
// Prints one JSON object: each attempt's record id, or its error reason and gateway reason.
import { contribute } from "../../dist/src/index.js";

const [url, studyId, key, credential] = process.argv.slice(2);
const x = [0.1, -0.2, 0.3];
const attempts = [
  ["slot0", { credential, slot: 0 }],
  ["slot1", { credential, slot: 1 }],
  ["slot0_again", { credential, slot: 0 }],
  ["none", {}],
  ["altered", { credential: credential.slice(0, -4) + (credential.endsWith("AAAA") ? "BBBB" : "AAAA") }],
];
const out = {};
for (const [name, options] of attempts) {
  try {
    out[name] = { recordId: (await contribute(url, studyId, key, x, 0.5, options)).recordId };
  } catch (error) {
    out[name] = { reason: error.reason ?? String(error), gatewayReason: error.gatewayReason,
      status: error.status };
  }
}
console.log(JSON.stringify(out));
