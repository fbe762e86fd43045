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
    `Before anything leaves this device, your example is clipped to ‖q‖² ≤ λ = ${num(s.lam)} ` +
      `and ‖p‖ ≤ P = ${num(s.pBound)}, and Gaussian noise of standard deviation ` +
      `${num(s.noise.stdQ)} (on q) and ${num(s.noise.stdP)} (on p) is added to every coordinate.`,
    "That noise protects you inside the aggregate of n records. One noisy record on its own " +
      "reveals much more about your example than a model does, so the service must guard the " +
      "records it receives like raw data.",
    `The study is ${verified.status}, signed by the owner's key ${verified.keyId}.`,
  ];
  return sentences;
}
