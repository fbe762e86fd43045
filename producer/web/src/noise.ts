/**
 * Gaussian noise from the platform's CSPRNG (`crypto.getRandomValues`), never `Math.random`.
 *
 * Method: Box–Muller on 53-bit uniforms. Each pair of normals takes four 32-bit words: two
 * make U₁ = (k₁ + 1)/2⁵³ ∈ (0, 1] (never 0, so log U₁ is finite) and two make U₂ = k₂/2⁵³ ∈ [0, 1),
 * with k uniform on the 2⁵³ integers below 2⁵³, i.e. every double of that grid equally likely.
 * Then Z₁ = √(−2 ln U₁)·cos(2πU₂) and Z₂ = √(−2 ln U₁)·sin(2πU₂) are independent N(0, 1)
 * (Box & Muller 1958). The grid bounds |Z| by √(2·53·ln 2) ≈ 8.57, a tail of probability
 * below 10⁻¹⁷; everything else the grid and libm's rounding change is in the last bits.
 * A fixed number of words per draw and no rejection loop: drawing takes the same time for every
 * outcome.
 */

import { IpdpError } from "./errors.js";

/** Fills an array with uniformly random 32-bit words. */
export type RandomFill = (words: Uint32Array<ArrayBuffer>) => void;

/** `crypto.getRandomValues` takes at most 65,536 bytes per call. */
const MAX_WORDS_PER_CALL = 16_384;
const TWO_POW_26 = 67_108_864;
const TWO_POW_53 = 9_007_199_254_740_992;

/** The platform's CSPRNG. */
export const cryptoFill: RandomFill = (words) => {
  const crypto = globalThis.crypto;
  if (crypto?.getRandomValues === undefined) {
    throw new IpdpError("unsupported_runtime", "crypto.getRandomValues is missing");
  }
  for (let at = 0; at < words.length; at += MAX_WORDS_PER_CALL) {
    crypto.getRandomValues(words.subarray(at, at + MAX_WORDS_PER_CALL));
  }
};

/** An integer uniform on [0, 2⁵³) from two words: 27 high bits of `hi`, 26 of `lo`. */
function uniformInteger53(hi: number, lo: number): number {
  return (hi >>> 5) * TWO_POW_26 + (lo >>> 6);
}

/** `count` independent N(0, std²) draws. */
export function gaussian(count: number, std: number, fill: RandomFill = cryptoFill): Float64Array {
  if (!Number.isSafeInteger(count) || count < 0) throw new RangeError(`count ${count} is not ≥ 0`);
  if (!(Number.isFinite(std) && std >= 0)) throw new RangeError(`std ${std} is not finite ≥ 0`);
  const out = new Float64Array(count);
  const pairs = Math.ceil(count / 2);
  const words = new Uint32Array(4 * pairs);
  fill(words);
  for (let i = 0; i < pairs; i++) {
    const u1 = (uniformInteger53(words[4 * i]!, words[4 * i + 1]!) + 1) / TWO_POW_53;
    const u2 = uniformInteger53(words[4 * i + 2]!, words[4 * i + 3]!) / TWO_POW_53;
    const radius = Math.sqrt(-2 * Math.log(u1));
    const angle = 2 * Math.PI * u2;
    out[2 * i] = std * radius * Math.cos(angle);
    if (2 * i + 1 < count) out[2 * i + 1] = std * radius * Math.sin(angle);
  }
  return out;
}

/** The device's noise: q̃ = q + u, p̃ = p − r. */
export interface Noise {
  readonly u: Float64Array;
  readonly r: Float64Array;
}

/** u ~ N(0, stdQ² I_d), r ~ N(0, stdP² I_d), the stds taken from the signed study. */
export function drawNoise(
  d: number,
  std: { readonly stdQ: number; readonly stdP: number },
  fill: RandomFill = cryptoFill,
): Noise {
  return { u: gaussian(d, std.stdQ, fill), r: gaussian(d, std.stdP, fill) };
}
