"""gateway.checks: the per-record verdicts, and the one-record shortcut agreeing with them."""

from __future__ import annotations

import uuid

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.checks import RECORD_OK, check_records, first_rejection, reason_of
from ipdp.study import Study
from ipdp.wire import RejectReason, encode_record, record_size

STUDY = Study(study_id="checks", d=3, n=1000, epsilon=1.0, delta=0.01)
SIZE = record_size(STUDY.d)


def good(seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return encode_record(STUDY.hash, uuid.UUID(int=seed).bytes, 1_700_000_000_000,
                         rng.normal(size=STUDY.d), rng.normal(size=STUDY.d))


def with_bytes(record: bytes, at: int, value: bytes) -> bytes:
    return record[:at] + value + record[at + len(value):]


def test_each_record_gets_the_reason_of_its_first_failed_check():
    nan = np.float64("nan").tobytes()
    body = [good(0),
            with_bytes(good(1), 0, b"\x09"),                 # version
            with_bytes(good(2), 1, b"\x01"),                 # reserved byte
            with_bytes(good(3), 4, (4).to_bytes(4, "little")),  # d
            with_bytes(good(4), 48 + 8, nan),                # q̃
            with_bytes(good(5), SIZE - 8, b"\x00" * 6 + b"\xf0\x7f"),  # p̃ = +Inf
            with_bytes(good(6), 8, b"\x00" * 16),            # study hash
            with_bytes(with_bytes(good(7), 0, b"\x09"), 48, nan)]  # two: the first wins
    verdict = check_records(b"".join(body), STUDY)
    assert [None if v == RECORD_OK else reason_of(int(v)) for v in verdict] == [
        None, RejectReason.UNSUPPORTED_VERSION, RejectReason.UNDECODABLE,
        RejectReason.WRONG_DIMENSION, RejectReason.NON_FINITE, RejectReason.NON_FINITE,
        RejectReason.STUDY_MISMATCH, RejectReason.UNSUPPORTED_VERSION]
    reason, detail = first_rejection(b"".join(body), STUDY)
    assert (reason, detail.split(":")[0]) == (RejectReason.UNSUPPORTED_VERSION, "record 1")


@settings(max_examples=300, deadline=None)
@given(at=st.integers(0, SIZE - 1), value=st.binary(min_size=1, max_size=8),
       seed=st.integers(0, 2**32 - 1))
def test_the_one_record_shortcut_agrees_with_the_vectorised_checks(at, value, seed):
    record = with_bytes(good(seed), at, value)[:SIZE]
    verdict = int(check_records(record, STUDY)[0])
    rejection = first_rejection(record, STUDY)
    assert (rejection is None) == (verdict == RECORD_OK)
    if rejection is not None:
        assert rejection[0] is reason_of(verdict)
