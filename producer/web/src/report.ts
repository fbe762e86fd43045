/** The privacy report of a verified study, in words a contributor can read before contributing. */

import type { VerifiedStudy } from "./study.js";

const LOSS_WORDS = {
  squared: "a linear regression (squared loss)",
  logistic: "a binary classifier (logistic loss)",
} as const;

/**
 * The share of the study's δ the aggregator's norm check spends; the noise spends the rest
 * (ipdp.calibration.REJECTION_DELTA_SHARE, docs/privacy.md "The norm check").
 */
export const NORM_CHECK_DELTA_SHARE = 1e-3;

function num(v: number): string {
  return Number.isInteger(v) ? v.toLocaleString("en-US") : String(Number(v.toPrecision(4)));
}

/** One sentence per fact: the model, the guarantee, the calibration, rounds, the device's part. */
export function privacyReport(verified: VerifiedStudy): string[] {
  const s = verified.study;
  const twoServer = twoServerOf(verified);
  const sentences = [
    s.schema === null
      ? `Study ${s.studyId} trains ${LOSS_WORDS[s.loss]} on d = ${num(s.d)} features.`
      : `Study ${s.studyId} trains ${LOSS_WORDS[s.loss]} predicting ${s.schema.target.name} ` +
        `from ${s.schema.features.map((f) => f.name).join(", ")}` +
        `${s.schema.intercept ? " and an intercept" : ""} (d = ${num(s.d)}); each value is ` +
        "mapped through its public range, and clipped to it, on this device.",
    `Each published model is computed from exactly n = ${num(s.n)} contributions and is ` +
      `(ε = ${num(s.epsilon)}, δ = ${num(s.delta)})-` +
      `differentially private: your one contribution changes the chance of any model by at ` +
      `most a factor e^ε ≈ ${num(Math.exp(s.epsilon))}, except with probability δ (of which ` +
      `${num(s.delta * NORM_CHECK_DELTA_SHARE)} is spent on the service's check of the ` +
      "records it receives).",
    s.mode === "rigorous"
      ? "The noise follows ipdp's rigorous calibration (the default), which repairs a gap in " +
        "the proof of the paper the method comes from."
      : s.mode === "paper"
        ? "The noise follows the paper's Algorithm 1 as published (paper mode), whose proof has " +
          "a known gap; ipdp's rigorous mode does not."
        : `The noise follows calibration mode "${s.mode}".`,
    s.maxRounds === null
      ? "The study has no fixed number of rounds; contributing to several rounds adds up the " +
        "privacy cost."
      : `The study publishes at most ${num(s.maxRounds)} model${s.maxRounds === 1 ? "" : "s"}; ` +
        "contributing to several rounds adds up the privacy cost.",
    ...(twoServer === null ? [
      `Before anything leaves this device, your example is clipped to ‖q‖² ≤ λ = ` +
        `${num(s.lam)} and ‖p‖ ≤ P = ${num(s.pBound)}, and Gaussian noise of standard ` +
        `deviation ${num(s.noise.stdQ)} (on q) and ${num(s.noise.stdP)} (on p) is added to ` +
        "every coordinate.",
      "That noise protects you inside the aggregate of n records. One noisy record on its own " +
        "reveals much more about your example than a model does, so the service must guard " +
        "the records it receives like raw data.",
    ] : [
      `Before anything leaves this device, your example is clipped to ‖q‖² ≤ λ = ` +
        `${num(s.lam)} and ‖p‖ ≤ P = ${num(s.pBound)}; Gaussian noise of standard deviation ` +
        `${num(s.noise.stdQ)} is added to q, and integer noise on a grid of standard deviation ` +
        `${num(s.noise.stdP)} to p.`,
      `This is a two-server study: your noisy record is split into two random shares, one ` +
        `for the service that receives it and one sealed to the helper ${twoServer.helperId} ` +
        `(${twoServer.helperUrl}), run apart from it. Neither can read your record alone; ` +
        "only the sum of a whole round of n records is put back together. The two together " +
        "would see the noisy record, as the one server of a one-server study does.",
    ]),
    `The study is ${verified.status}, signed by the owner's key ${verified.keyId}.`,
  ];
  return sentences;
}

/** The helper of a two-server study (its signed `two_server` block), or null. Only the names a
 * report shows are read; the device's encoding is src/two-server.ts's. */
function twoServerOf(verified: VerifiedStudy): { helperId: string; helperUrl: string } | null {
  const block = verified.study.fields["two_server"];
  if (block === undefined || block === null || typeof block !== "object") return null;
  const { helper_id: helperId, helper_url: helperUrl } = block as Record<string, unknown>;
  return { helperId: String(helperId), helperUrl: String(helperUrl) };
}
