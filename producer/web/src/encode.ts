/**
 * One example (x, y) → the quadratic-loss pair (q, p), clipped to the study's public bounds.
 *
 * The same arithmetic as ipdp/losses.py, operation for operation, so that the same inputs give
 * the same doubles: squared q = x, p = y·x; logistic q = x/2, p = (y·x)/2 with y ∈ {−1, +1};
 * clipping scales a row by min(1, bound / max(‖row‖, tiny)).
 */

import { IpdpError } from "./errors.js";
import type { Noise } from "./noise.js";
import type { Loss } from "./study.js";

export interface QuadraticPair {
  readonly q: Float64Array;
  readonly p: Float64Array;
}

/** numpy's finfo(float64).tiny, the smallest normal double: the guard against ‖row‖ = 0. */
const TINY = 2.2250738585072014e-308;
/** numpy's PW_BLOCKSIZE: pairwise summation recurses above this many terms. */
const PAIRWISE_BLOCK = 128;

/** Validate one example against the study and encode it (paper §3.1). */
export function encodeExample(loss: Loss, x: ArrayLike<unknown>, y: unknown, d: number): QuadraticPair {
  if (x.length !== d) {
    throw new IpdpError(
      "wrong_dimension", `x has ${x.length} value${x.length === 1 ? "" : "s"}; the study needs d = ${d}`);
  }
  const xs = new Float64Array(d);
  for (let i = 0; i < d; i++) {
    const v = x[i];
    if (typeof v !== "number" || !Number.isFinite(v)) {
      throw new IpdpError("invalid_example", `x[${i}] is ${String(v)}, not a finite number`);
    }
    xs[i] = v;
  }
  if (typeof y !== "number" || !Number.isFinite(y)) {
    throw new IpdpError("invalid_example", `y is ${String(y)}, not a finite number`);
  }
  if (loss === "squared") return { q: xs, p: xs.map((v) => y * v) };
  if (y !== 1 && y !== -1) {
    throw new IpdpError("invalid_example", `logistic loss needs a label y of −1 or +1, got ${y}`);
  }
  return { q: xs.map((v) => v / 2), p: xs.map((v) => (y * v) / 2) };
}

/**
 * ‖v‖₂ with numpy's summation order (pairwise, eight accumulators per block of ≤ 128 terms):
 * np.linalg.norm gives the same double, so a clipped row is bit-identical to Python's.
 */
export function norm(v: Float64Array): number {
  return Math.sqrt(pairwiseSum(v.map((x) => x * x), 0, v.length));
}

function pairwiseSum(a: Float64Array, start: number, n: number): number {
  if (n < 8) {
    let res = 0;
    for (let i = 0; i < n; i++) res += a[start + i]!;
    return res;
  }
  if (n <= PAIRWISE_BLOCK) {
    const r = a.slice(start, start + 8);
    let i = 8;
    for (; i < n - (n % 8); i += 8) {
      for (let j = 0; j < 8; j++) r[j]! += a[start + i + j]!;
    }
    let res = ((r[0]! + r[1]!) + (r[2]! + r[3]!)) + ((r[4]! + r[5]!) + (r[6]! + r[7]!));
    for (; i < n; i++) res += a[start + i]!;
    return res;
  }
  let half = Math.floor(n / 2);
  half -= half % 8;
  return pairwiseSum(a, start, half) + pairwiseSum(a, start + half, n - half);
}

/** Scale v down to ‖v‖ ≤ bound; a row inside the ball comes back unchanged. */
export function clipRow(v: Float64Array, bound: number): Float64Array {
  const scale = Math.min(1, bound / Math.max(norm(v), TINY));
  return v.map((x) => x * scale);
}

/** Public, data-independent clipping to ‖q‖² ≤ λ and ‖p‖ ≤ P. */
export function clipPair(pair: QuadraticPair, lam: number, pBound: number): QuadraticPair {
  return { q: clipRow(pair.q, Math.sqrt(lam)), p: clipRow(pair.p, pBound) };
}

/** q̃ = q + u, p̃ = p − r (paper Algorithm 1). */
export function addNoise(pair: QuadraticPair, noise: Noise): QuadraticPair {
  const d = pair.q.length;
  if (pair.p.length !== d || noise.u.length !== d || noise.r.length !== d) {
    throw new RangeError(`q, p, u and r must all have length ${d}`);
  }
  return { q: pair.q.map((v, i) => v + noise.u[i]!), p: pair.p.map((v, i) => v - noise.r[i]!) };
}
