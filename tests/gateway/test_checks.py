"""gateway.checks: the per-record verdicts, and the one-record shortcut agreeing with them."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.batch import Message, Polled
from aggregator.validate import Validator
from gateway.checks import RECORD_OK, check_records, reason_of, why_refused
from ipdp.study import Study
from ipdp.wire import (
    CREATED_MS_BYTES,
    D_BYTES,
    RECORD_ID_BYTES,
    RESERVED_BYTES,
    STUDY_HASH_BYTES,
    VALUES_OFFSET,
    VERSION_BYTE,
    RecordWindow,
    RejectReason,
    record_size,
)
from producer.contributor import perturb_records

STUDY = Study(study_id="checks", d=3, n=1000, epsilon=1.0, delta=0.01)
SIZE = record_size(STUDY.d)
NOW_MS = 1_700_000_000_000
WINDOW = RecordWindow(replay_window_ms=86_400_000, max_future_skew_ms=300_000)


def good(seed: int = 0, created_ms: int = NOW_MS) -> bytes:
    """An honest record: clipped, perturbed as a device does (seeded)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, STUDY.d)) / np.sqrt(STUDY.d)
    record = perturb_records(STUDY, x, np.clip(x[:, 0], -1, 1), rng)[1][0]
    return with_bytes(with_bytes(record, RECORD_ID_BYTES.start, uuid.UUID(int=seed).bytes),
                      CREATED_MS_BYTES.start,
                      created_ms.to_bytes(8, "little", signed=True))


def scaled(record: bytes, q_scale: float, p_scale: float) -> bytes:
    """The record with q̃ and p̃ multiplied by the given factors."""
    values = np.frombuffer(record, "<f8", offset=VALUES_OFFSET).copy()
    values[:STUDY.d] *= q_scale
    values[STUDY.d:] *= p_scale
    return record[:VALUES_OFFSET] + values.tobytes()


def with_bytes(record: bytes, at: int, value: bytes) -> bytes:
    return record[:at] + value + record[at + len(value):]


#: Where the fields a test alters start.
VERSION, RESERVED, DIM, HASH = (VERSION_BYTE, RESERVED_BYTES.start, D_BYTES.start,
                                STUDY_HASH_BYTES.start)


def test_each_record_gets_the_reason_of_its_first_failed_check():
    nan = np.float64("nan").tobytes()
    body = [good(0),
            with_bytes(good(1), VERSION, b"\x09"),
            with_bytes(good(2), RESERVED, b"\x01"),
            with_bytes(good(3), DIM, (4).to_bytes(4, "little")),
            with_bytes(good(4), VALUES_OFFSET + 8, nan),       # q̃
            with_bytes(good(5), SIZE - 8, b"\x00" * 6 + b"\xf0\x7f"),  # p̃ = +Inf
            with_bytes(good(6), HASH, b"\x00" * 16),
            with_bytes(with_bytes(good(7), VERSION, b"\x09"), VALUES_OFFSET, nan),  # the first wins
            scaled(good(8), 100.0, 1.0),                     # ‖q̃‖ above its bound
            scaled(good(9), 1.0, 0.0),                       # p̃ = 0: no noise
            good(10, created_ms=NOW_MS - WINDOW.replay_window_ms - 1),
            good(11, created_ms=NOW_MS + WINDOW.max_future_skew_ms + 1),
            good(12, created_ms=NOW_MS - WINDOW.replay_window_ms),  # both edges are inside
            good(13, created_ms=NOW_MS + WINDOW.max_future_skew_ms),
            scaled(good(14, created_ms=0), 100.0, 1.0),      # norm before time
            with_bytes(with_bytes(good(15), DIM, (4).to_bytes(4, "little")), RESERVED, b"\x01"),
            with_bytes(with_bytes(good(16), HASH, b"\x00" * 16), DIM, (4).to_bytes(4, "little")),
            with_bytes(with_bytes(good(17), HASH, b"\x00" * 16), VALUES_OFFSET, nan),
            with_bytes(scaled(good(18), 100.0, 1.0), HASH, b"\x00" * 16)]
    verdict = check_records(b"".join(body), STUDY, WINDOW, NOW_MS)
    assert [None if v == RECORD_OK else reason_of(int(v)) for v in verdict] == [
        None, RejectReason.UNSUPPORTED_VERSION, RejectReason.UNDECODABLE,
        RejectReason.WRONG_DIMENSION, RejectReason.NON_FINITE, RejectReason.NON_FINITE,
        RejectReason.STUDY_MISMATCH, RejectReason.UNSUPPORTED_VERSION,
        RejectReason.NORM_OUT_OF_BOUNDS, RejectReason.NORM_OUT_OF_BOUNDS, RejectReason.STALE,
        RejectReason.FUTURE, None, None, RejectReason.NORM_OUT_OF_BOUNDS,
        RejectReason.UNDECODABLE, RejectReason.WRONG_DIMENSION, RejectReason.NON_FINITE,
        RejectReason.STUDY_MISMATCH]
    reason, detail = why_refused(b"".join(body), STUDY, WINDOW, NOW_MS)
    assert (reason, detail.split(":")[0]) == (RejectReason.UNSUPPORTED_VERSION, "record 1")
    # A device's request holds one record: each, alone, gets the same reason from the scalar
    # checks of why_refused, without the vectorised pass.
    alone = [why_refused(record, STUDY, WINDOW, NOW_MS) for record in body]
    assert [None if r is None else r[0] for r in alone] == [
        None if v == RECORD_OK else reason_of(int(v)) for v in verdict]
    assert all(r is None or r[1].startswith("record 0: ") for r in alone)


@settings(max_examples=300, deadline=None)
@given(at=st.integers(0, SIZE - 1), value=st.binary(min_size=1, max_size=8),
       seed=st.integers(0, 2**32 - 1))
def test_the_one_record_shortcut_agrees_with_the_vectorised_checks(at, value, seed):
    record = with_bytes(good(seed), at, value)[:SIZE]
    verdict = int(check_records(record, STUDY, WINDOW, NOW_MS)[0])
    rejection = why_refused(record, STUDY, WINDOW, NOW_MS)
    assert (rejection is None) == (verdict == RECORD_OK)
    if rejection is not None:
        assert rejection[0] is reason_of(verdict)


@pytest.mark.parametrize(("record", "reason", "detail"), [
    (scaled(good(1), 100.0, 1.0), RejectReason.NORM_OUT_OF_BOUNDS, "‖q̃‖ exceeds"),
    (scaled(good(2), 1.0, 100.0), RejectReason.NORM_OUT_OF_BOUNDS, "‖p̃‖ exceeds"),
    (scaled(good(3), 0.0, 1.0), RejectReason.NORM_OUT_OF_BOUNDS, "‖q̃‖ is below"),
    (scaled(good(4), 1.0, 1e-3), RejectReason.NORM_OUT_OF_BOUNDS, "‖p̃‖ is below"),
    (good(5, created_ms=NOW_MS - 86_400_001), RejectReason.STALE, "replay window"),
    (good(6, created_ms=NOW_MS + 300_001), RejectReason.FUTURE, "in the future"),
])
def test_a_record_the_aggregator_would_dead_letter_is_refused_with_its_reason(record, reason,
                                                                               detail):
    got, text = why_refused(record, STUDY, WINDOW, NOW_MS)
    assert got is reason and text.startswith("record 0: ") and detail in text


def aggregator_reasons(record: bytes) -> list[RejectReason]:
    """The reasons the aggregator's stateless checks dead-letter ``record`` with at NOW_MS."""
    validator = Validator(replay_window_s=WINDOW.replay_window_ms // 1000,
                          max_future_skew_s=WINDOW.max_future_skew_ms // 1000,
                          max_message_bytes=1 << 16)
    polled = Polled.of([Message(0, 0, record)])
    rejects, _ = validator.validate(polled, validator.decode(polled), {STUDY.hash: STUDY}, {},
                                    NOW_MS)
    return [r.reason for r in rejects]


@pytest.mark.parametrize("bound", ["q_high", "p_high", "q_low", "p_low"])
def test_a_record_at_a_norm_bound_gets_the_aggregators_verdict(bound):
    """Norms within a few ulps of a bound: the shortcut leaves them to the vectorised pass."""
    target = getattr(STUDY.norm_bounds, bound)
    verdicts = set()
    for seed in range(20):
        record = good(seed)
        values = np.frombuffer(record, "<f8", offset=VALUES_OFFSET)
        part = values[:STUDY.d] if bound.startswith("q") else values[STUDY.d:]
        for ulps in range(-3, 4):
            factor = target / np.linalg.norm(part) * (1 + ulps * 2.0**-52)
            near = scaled(record, *((factor, 1.0) if bound.startswith("q") else (1.0, factor)))
            rejection = why_refused(near, STUDY, WINDOW, NOW_MS)
            assert aggregator_reasons(near) == ([] if rejection is None else [rejection[0]])
            verdicts.add(rejection is None)
    assert verdicts == {True, False}  # both sides of the bound were reached


@settings(max_examples=200, deadline=None)
@given(q_scale=st.floats(0.0, 3.0), p_scale=st.floats(0.0, 3.0),
       shift_ms=st.integers(-90_000_000, 1_000_000), seed=st.integers(0, 2**32 - 1))
def test_the_gateway_refuses_a_record_exactly_when_the_aggregator_would(q_scale, p_scale,
                                                                         shift_ms, seed):
    record = scaled(good(seed, created_ms=NOW_MS + shift_ms), q_scale, p_scale)
    rejection = why_refused(record, STUDY, WINDOW, NOW_MS)
    assert aggregator_reasons(record) == ([] if rejection is None else [rejection[0]])


def test_a_record_id_twice_in_a_request_is_refused_naming_both_records():
    twin = with_bytes(good(7), RECORD_ID_BYTES.start, uuid.UUID(int=2).bytes)  # good(2)'s id
    body = b"".join([good(1), good(2), good(3), twin, good(4)])
    verdict = check_records(body, STUDY, WINDOW, NOW_MS)
    assert [None if v == RECORD_OK else reason_of(int(v)) for v in verdict] == [
        None, None, None, RejectReason.DUPLICATE_RECORD, None]
    reason, detail = why_refused(body, STUDY, WINDOW, NOW_MS)
    assert reason is RejectReason.DUPLICATE_RECORD
    assert detail.startswith("record 3 has the record id of record 1")
    # A record's own failure comes before its being a copy.
    stale_twin = with_bytes(twin, CREATED_MS_BYTES.start, (0).to_bytes(8, "little"))
    assert why_refused(good(2) + stale_twin, STUDY, WINDOW, NOW_MS)[0] is RejectReason.STALE
