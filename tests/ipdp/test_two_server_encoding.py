"""The two-server fixed-point encoding and its additive shares (ipdp.fixed_point): the layout,
the shares' uniformity, reconstruction, the rounding bound of a sum, the range, test vectors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError
from scipy.stats import chisquare

from ipdp.fixed_point import (
    SIGNED_MAX,
    FixedPoint,
    combine,
    decode,
    encode,
    entries,
    fold,
    fraction_bits_for,
    split,
)

VECTORS = Path(__file__).with_name("two_server_vectors.json")


def _fp(d: int = 3, n: int = 1000, clamp_log2: int = 2) -> FixedPoint:
    return FixedPoint(d=d, n=n, fraction_bits=fraction_bits_for(n, clamp_log2),
                      clamp_log2=clamp_log2)


def test_a_record_is_the_upper_triangle_row_major_then_the_linear_term():
    fp = FixedPoint(d=3, n=2, fraction_bits=8, clamp_log2=4)
    q = np.array([1.0, 2.0, 3.0])
    p = np.array([0.5, -0.25, 4.0])
    values, clamped = encode(q, p, fp)
    signed = values.view(np.int64) / 2.0**8
    assert entries(3) == 9 and values.shape == (9,) and clamped == 0
    np.testing.assert_array_equal(signed, [1, 2, 3, 4, 6, 9, 0.5, -0.25, 4.0])


def test_a_batch_encodes_like_its_records_one_by_one():
    fp = _fp()
    rng = np.random.default_rng(1)
    q, p = rng.normal(size=(50, 3)), np.ldexp(np.rint(np.ldexp(rng.normal(size=(50, 3)), 16)), -16)
    batch, _ = encode(q, p, fp)
    np.testing.assert_array_equal(batch, np.stack([encode(q[i], p[i], fp)[0] for i in range(50)]))


def _byte_uniformity(words: np.ndarray) -> float:
    counts = np.bincount(np.frombuffer(words.astype("<u8").tobytes(), dtype=np.uint8),
                         minlength=256)
    return chisquare(counts).pvalue


def test_either_share_alone_is_uniform_whatever_the_records():
    # Records far from uniform (all the same small values) still give uniform shares.
    fp = _fp()
    values, _ = encode(np.full((20_000, 3), 0.3), np.full((20_000, 3), 0.5), fp)
    assert _byte_uniformity(values) < 1e-6  # the check has power: the records fail it
    leader, helper = split(values, np.random.default_rng(2).bytes)
    assert _byte_uniformity(leader) > 1e-4 and _byte_uniformity(helper) > 1e-4
    # Each 64-bit word's top bit (the sign a decoder would read) is a fair coin.
    for share in (leader, helper):
        top = np.count_nonzero(share >> np.uint64(63)) / share.size
        assert abs(top - 0.5) < 5 * 0.5 / np.sqrt(share.size)


def test_reconstruction_needs_both_shares():
    fp = _fp()
    rng = np.random.default_rng(3)
    q, p = rng.normal(0, 0.3, size=(200, 3)), np.zeros((200, 3))
    values, _ = encode(q, p, fp)
    leader, helper = split(values, rng.bytes)
    a, _ = decode(combine(fold(leader), fold(helper)), fp)
    np.testing.assert_allclose(a, q.T @ q, atol=1e-9)
    a_leader, _ = decode(fold(leader), fp)
    a_helper, _ = decode(fold(helper), fp)
    assert np.abs(a_leader - q.T @ q).min() > 1.0 and np.abs(a_helper - q.T @ q).min() > 1.0


def test_the_sum_of_n_encoded_records_is_the_sum_within_the_rounding_bound():
    n, d = 5_000, 4
    fp = _fp(d=d, n=n, clamp_log2=3)
    rng = np.random.default_rng(4)
    q = rng.normal(0, 0.5, size=(n, d))
    p = np.ldexp(np.rint(np.ldexp(rng.normal(size=(n, d)), 20)), -20)  # on a 2⁻²⁰ grid
    values, clamped = encode(q, p, fp)
    assert clamped == 0
    leader, helper = split(values, rng.bytes)
    a, b = decode(combine(fold(leader), fold(helper)), fp)
    exact = q.T @ q
    # Each entry's rounding is at most h/2 plus the product's 2⁻⁵³ relative error; the decode to
    # float64 adds at most half an ulp of the sum.
    per_record = fp.step / 2 + 2.0**-53 * np.max(q**2)
    bound = n * per_record + np.spacing(np.abs(exact).max()) + 1e-9 * np.abs(exact)
    assert np.all(np.abs(a - exact) <= bound)
    np.testing.assert_array_equal(b, np.ldexp(np.rint(np.ldexp(p, 20)).sum(axis=0), -20))
    np.testing.assert_array_equal(a, a.T)


@pytest.mark.parametrize("n", [1, 2, 1000, 1024, 10**6, 2**40 + 1])
def test_n_records_at_the_range_end_do_not_wrap_at_the_chosen_fraction_bits(n):
    fp = _fp(d=1, n=n, clamp_log2=2)
    assert n * fp.limit <= SIGNED_MAX < n * 2 * fp.limit  # the largest f that fits
    for sign in (1.0, -1.0):
        one, clamped = encode(np.array([10.0]), np.array([sign * 100.0]), fp)
        assert clamped == 2  # q̃² = 100 and |p̂| = 100 both exceed B = 4
        # n copies summed mod 2⁶⁴, without materialising them: n·v mod 2⁶⁴.
        total = np.array([int(v) * n % 2**64 for v in one], dtype=np.uint64)
        a, b = decode(total, fp)
        assert a[0, 0] == pytest.approx(4.0 * n) and b[0] == pytest.approx(sign * 4.0 * n)


def test_fraction_bits_that_could_wrap_are_refused_with_the_largest_that_fits():
    f = fraction_bits_for(1000, 2)
    with pytest.raises(ValidationError, match=f"exceeds 2⁶³ − 1.*at most f = {f} fraction bits"):
        FixedPoint(d=3, n=1000, fraction_bits=f + 1, clamp_log2=2)


def test_entries_beyond_the_range_are_clamped_and_counted():
    fp = FixedPoint(d=2, n=4, fraction_bits=10, clamp_log2=0)
    values, clamped = encode(np.array([[3.0, 0.1]]), np.array([[-5.0, 0.5]]), fp)
    np.testing.assert_array_equal(values.view(np.int64)[0] / 2.0**10,
                                  [1.0, 307 / 1024, 10 / 1024, -1.0, 0.5])
    assert clamped == 2
    # An entry exactly at the range's end is within it: kept, and not counted.
    values, clamped = encode(np.array([[1.0, 0.0]]), np.array([[-1.0, 0.0]]), fp)
    assert clamped == 0 and values.view(np.int64)[0].tolist() == [1024, 0, 0, -1024, 0]


def test_non_finite_or_misshapen_statistics_are_refused():
    fp = _fp()
    with pytest.raises(ValueError, match="^q̃ and p̂ must be finite$"):
        encode(np.array([np.nan, 0.0, 0.0]), np.zeros(3), fp)
    with pytest.raises(ValueError, match="shape"):
        encode(np.zeros(2), np.zeros(3), fp)
    with pytest.raises(ValueError, match="shape"):  # both alike, but not of the study's d
        encode(np.zeros(4), np.zeros(4), fp)


def test_integer_statistics_beyond_the_range_are_clamped_not_wrapped():
    """q̃q̃ᵀ is formed in double precision even from integers (2³²·2³² would wrap to 0 in int64),
    and a linear term too large for any integer type is clamped like any other."""
    fp = FixedPoint(d=2, n=4, fraction_bits=10, clamp_log2=3)
    values, clamped = encode(np.array([2**32, 0]), np.array([2**70, 0]), fp)
    assert clamped == 2
    assert values.view(np.int64).tolist() == [fp.limit, 0, 0, fp.limit, 0]


def test_the_shared_test_vectors_are_what_the_implementation_produces():
    cases = json.loads(VECTORS.read_text())["cases"]
    assert {c["name"] for c in cases} == {"ties-half-to-even", "clamp", "round-of-three"}
    for case in cases:
        fp = FixedPoint(**case["encoding"])
        q, p = np.array(case["q_tilde"]), np.array(case["p_hat"])
        values, clamped = encode(q, p, fp)
        values = values.reshape(-1, fp.entries)
        assert [str(int(v)) for v in values.reshape(-1)] == case["values"]
        assert clamped == case["clamped"]
        helper_bytes = b"".join(bytes.fromhex(h) for h in case["helper_share_hex"])
        leader, helper = split(values, lambda count, data=helper_bytes: data[:count])
        assert [w.astype("<u8").tobytes().hex() for w in helper] == case["helper_share_hex"]
        assert [w.astype("<u8").tobytes().hex() for w in leader] == case["leader_share_hex"]
        total = combine(fold(leader), fold(helper))
        assert [str(int(v)) for v in total.view(np.int64)] == case["sum_values"]
        a, b = decode(total, fp)
        assert a.tolist() == case["sum_a"] and b.tolist() == case["sum_b"]


def test_a_tiny_range_gets_at_most_62_fraction_bits():
    assert fraction_bits_for(1, -20) == 62
    fp = FixedPoint(d=1, n=1, fraction_bits=fraction_bits_for(1, -20), clamp_log2=-20)
    values, clamped = encode(np.array([2.0**-11]), np.array([2.0**-30]), fp)
    assert clamped == 0 and values.view(np.int64).tolist() == [2**40, 2**32]


def test_ring_elements_given_as_python_integers_split_and_combine_mod_2_64():
    """Shares and sums combine mod 2⁶⁴ whatever integer form they arrive in (numpy reads small
    Python integers as int64, large ones as uint64), and decoding names the length a sum needs."""
    fp = _fp(d=2)
    small, large = [3, 1, 0, 5, 2], [2**64 - 1, 2**64 - 1, 7, 2**64 - 5, 2**63]
    for leader, helper in [(small, large), (large, small)]:
        total = combine(leader, helper)
        assert total.dtype == np.uint64 and total.tolist() == [2, 0, 7, 0, 2**63 + 2]
    rng = np.random.default_rng(5)
    leader, helper = split(small, rng.bytes)
    assert leader.dtype == np.uint64 and combine(leader, helper).tolist() == small
    with pytest.raises(ValueError, match=r"a sum must have 5 entries at d=2, got \(4,\)"):
        decode(np.zeros(4, dtype=np.uint64), fp)
