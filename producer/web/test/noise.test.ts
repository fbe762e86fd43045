/**
 * The noise is N(0, std²), checked on 200,000 draws from the real CSPRNG. Each check's threshold
 * puts its false-failure rate near 2·10⁻⁹, and each is shown to catch a generator that is
 * wrong in the way it targets (std off by 5 %, uniform shape, correlated pairs).
 */

import assert from "node:assert/strict";
import { test } from "node:test";

import { cryptoFill, drawNoise, gaussian, newRecordId } from "../src/index.js";

const N = 200_000;
const STD = 0.7;
/** |z| ≥ 6 for a standard normal statistic: probability 1.97·10⁻⁹. */
const Z_LIMIT = 6;
/** Upper 10⁻⁹ quantile of χ² with 15 degrees of freedom (scipy.stats.chi2.isf(1e-9, 15)). */
const CHI2_15_LIMIT = 73.63;
/** Bin edges in units of σ and Φ at the non-positive ones (scipy.stats.norm.cdf). */
const EDGES = [-3.5, -3, -2.5, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5];
const PHI_LOWER = [
  0.00023262907903552502, 0.0013498980316300933, 0.006209665325776132, 0.022750131948179195,
  0.06680720126885807, 0.15865525393145707, 0.3085375387259869, 0.5,
];

/** Φ at every edge, by symmetry. */
const PHI = [...PHI_LOWER, ...PHI_LOWER.slice(0, 7).reverse().map((p) => 1 - p)];

interface Verdict {
  variance: number;
  mean: number;
  lagOneCorrelation: number;
  shapeChi2: number;
  failures: string[];
}

/** Test `samples` against N(0, std²): z-scores of variance, mean, lag-1 correlation; χ² of shape. */
function checkNormal(samples: Float64Array, std: number): Verdict {
  const n = samples.length;
  let sumSq = 0;
  let sum = 0;
  let lag = 0;
  const counts = new Array<number>(EDGES.length + 1).fill(0);
  for (let i = 0; i < n; i++) {
    const z = samples[i]! / std;
    sum += z;
    sumSq += z * z;
    if (i + 1 < n) lag += z * (samples[i + 1]! / std);
    let bin = 0;
    while (bin < EDGES.length && z >= EDGES[bin]!) bin++;
    counts[bin]!++;
  }
  // Σz² ~ χ²_n: mean n, variance 2n. Σz ~ N(0, n). Σ z_i z_{i+1}: mean 0, variance n − 1.
  const variance = (sumSq - n) / Math.sqrt(2 * n);
  const mean = sum / Math.sqrt(n);
  const lagOneCorrelation = lag / Math.sqrt(n - 1);
  let shapeChi2 = 0;
  for (let b = 0; b <= EDGES.length; b++) {
    const expected = n * ((b < EDGES.length ? PHI[b]! : 1) - (b > 0 ? PHI[b - 1]! : 0));
    shapeChi2 += (counts[b]! - expected) ** 2 / expected;
  }
  const failures: string[] = [];
  if (Math.abs(variance) >= Z_LIMIT) failures.push(`variance z = ${variance.toFixed(2)}`);
  if (Math.abs(mean) >= Z_LIMIT) failures.push(`mean z = ${mean.toFixed(2)}`);
  if (Math.abs(lagOneCorrelation) >= Z_LIMIT) {
    failures.push(`lag-1 correlation z = ${lagOneCorrelation.toFixed(2)}`);
  }
  if (shapeChi2 >= CHI2_15_LIMIT) failures.push(`shape χ²₁₅ = ${shapeChi2.toFixed(1)}`);
  return { variance, mean, lagOneCorrelation, shapeChi2, failures };
}

const draws = gaussian(N, STD);

test("200,000 draws are N(0, std²): variance, mean, independence and shape", () => {
  const verdict = checkNormal(draws, STD);
  assert.deepEqual(verdict.failures, [], JSON.stringify(verdict));
});

test("the check catches a std 5 % too large (and 5 % too small)", () => {
  const scaled = (f: number) => draws.map((z) => z * f);
  assert.ok(checkNormal(scaled(1.05), STD).failures.some((f) => f.startsWith("variance")));
  assert.ok(checkNormal(scaled(1 / 1.05), STD).failures.some((f) => f.startsWith("variance")));
});

test("the check catches a uniform of the right variance, and pairs that repeat", () => {
  const words = new Uint32Array(N);
  cryptoFill(words);
  const uniform = Float64Array.from(words, (w) => (w / 2 ** 32 - 0.5) * Math.sqrt(12) * STD);
  const uniformVerdict = checkNormal(uniform, STD);
  assert.ok(Math.abs(uniformVerdict.variance) < Z_LIMIT, "same variance");
  assert.ok(uniformVerdict.failures.some((f) => f.startsWith("shape")));
  const repeated = draws.map((_, i) => draws[i - (i % 2)]!);
  assert.ok(checkNormal(repeated, STD).failures.some((f) => f.startsWith("lag-1")));
});

test("drawNoise uses the study's std_q for u and std_p for r", () => {
  const noise = drawNoise(N / 2, { stdQ: 0.01, stdP: 30 });
  assert.deepEqual(checkNormal(noise.u, 0.01).failures.filter((f) => f.startsWith("variance")), []);
  assert.deepEqual(checkNormal(noise.r, 30).failures.filter((f) => f.startsWith("variance")), []);
  assert.ok(checkNormal(noise.u, 30).failures.length > 0, "u is not drawn at std_p");
});

test("extreme random words give finite draws: U₁ is never 0", () => {
  const zeros = gaussian(2, 1, (w) => w.fill(0));
  assert.ok(Math.abs(zeros[0]! - Math.sqrt(2 * 53 * Math.LN2)) < 1e-12);
  const ones = gaussian(3, 1, (w) => w.fill(0xffffffff));
  assert.ok(ones.every((z) => Number.isFinite(z) && Math.abs(z) < 1e-7));
  assert.equal(gaussian(0, 1).length, 0);
});

test("the CSPRNG fill covers arrays larger than one getRandomValues call", () => {
  const words = new Uint32Array(40_000);
  cryptoFill(words);
  assert.ok(words.subarray(16_384).some((w) => w !== 0) && words.subarray(32_768).some((w) => w !== 0));
});

test("record ids are random and UUID-version-4 shaped", () => {
  const ids = Array.from({ length: 64 }, () => newRecordId());
  for (const id of ids) {
    assert.equal(id.length, 16);
    assert.equal(id[6]! >> 4, 4);
    assert.equal(id[8]! >> 6, 2);
  }
  assert.equal(new Set(ids.map((id) => Buffer.from(id).toString("hex"))).size, ids.length);
});
