"""gateway.checks on a two-server study's version-3 records: the checks the leader can make
without reading a record (layout, version, d, proof length, study hash, record window, an id
twice in a request), the same verdict on the numpy and the one-record path, no norm check, and a
record of the other kind refused with a reason that says which kind the study takes."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from gateway.checks import check_records, reason_of, study_record_size, why_refused
from ipdp.study import Study
from ipdp.two_server_wire import TwoServerLayout, two_server_record_size
from ipdp.wire import (
    CREATED_MS_BYTES,
    D_BYTES,
    RECORD_ID_BYTES,
    RESERVED_BYTES,
    STUDY_HASH_BYTES,
    VERSION_BYTE,
    RecordWindow,
    RejectReason,
    record_size,
)
from producer.contributor import perturb_records
from tests.ipdp.test_two_server_wire import HELPER

D = 3
STUDY = Study(study_id="two-checks", d=D, n=1000, epsilon=1.0, delta=0.01,
              two_server={"helper_id": "helper-a", "helper_url": "https://helper.example.org",
                          "helper_key": HELPER.public_b64})
ONE_SERVER = Study(study_id="one-checks", d=D, n=1000, epsilon=1.0, delta=0.01)
LAYOUT = TwoServerLayout(D)
NOW_MS = 1_700_000_000_000
WINDOW = RecordWindow(replay_window_ms=86_400_000, max_future_skew_ms=300_000)


def record(seed: int = 0, created_ms: int = NOW_MS, study: Study = STUDY) -> bytes:
    """An honest record of ``study`` as a device makes it (seeded), with id ``seed``."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(1, D)) / np.sqrt(D)
    value = perturb_records(study, x, np.clip(x[:, 0], -1, 1), rng, grid_generator=rng,
                            random_bytes=rng.bytes)[1][0]
    value = with_bytes(value, RECORD_ID_BYTES.start, uuid.UUID(int=seed).bytes)
    return with_bytes(value, CREATED_MS_BYTES.start,
                      created_ms.to_bytes(8, "little", signed=True))


def with_bytes(value: bytes, at: int, new: bytes) -> bytes:
    return value[:at] + new + value[at + len(new):]


def test_a_two_server_study_takes_records_of_the_version_3_size():
    assert study_record_size(STUDY) == two_server_record_size(D) == LAYOUT.size == 244
    assert study_record_size(ONE_SERVER) == record_size(D)
    assert len(record()) == LAYOUT.size


def test_each_version_3_record_gets_the_reason_of_its_first_failed_check():
    body = [record(0),
            with_bytes(record(1), VERSION_BYTE, b"\x01"),
            with_bytes(record(2), RESERVED_BYTES.start, b"\x01"),
            with_bytes(record(3), D_BYTES.start, (4).to_bytes(4, "little")),
            with_bytes(record(4), LAYOUT.proof_length.start, (32).to_bytes(4, "little")),
            with_bytes(record(5), STUDY_HASH_BYTES.start, b"\x00" * 16),
            record(6, created_ms=NOW_MS - WINDOW.replay_window_ms - 1),
            record(7, created_ms=NOW_MS + WINDOW.max_future_skew_ms + 1),
            record(8, created_ms=NOW_MS - WINDOW.replay_window_ms),  # both edges are inside
            record(9, created_ms=NOW_MS + WINDOW.max_future_skew_ms),
            # The leader's share is not read: any 8·L bytes pass (no norm check).
            with_bytes(record(10), LAYOUT.leader.start, b"\xff" * LAYOUT.share_size),
            with_bytes(with_bytes(record(11), VERSION_BYTE, b"\x01"), D_BYTES.start,
                       (4).to_bytes(4, "little")),  # the first failure wins
            record(0)]  # the id of record 0 again
    expected = [None, RejectReason.UNSUPPORTED_VERSION, RejectReason.UNDECODABLE,
                RejectReason.WRONG_DIMENSION, RejectReason.UNDECODABLE,
                RejectReason.STUDY_MISMATCH, RejectReason.STALE, RejectReason.FUTURE, None, None,
                None, RejectReason.UNSUPPORTED_VERSION, RejectReason.DUPLICATE_RECORD]
    verdict = check_records(b"".join(body), STUDY, WINDOW, NOW_MS)
    assert [None if v == 0 else reason_of(int(v)) for v in verdict] == expected
    # The one-record path (a device's request) gives each record the same verdict.
    alone = [why_refused(r, STUDY, WINDOW, NOW_MS) for r in body[:-1]]
    assert [None if a is None else a[0] for a in alone] == expected[:-1]
    assert alone[4][1] == "record 0: a validity proof is not accepted yet (proof length ≠ 0)"
    assert alone[1][1].startswith("record 0: version 1 holds q̃ and p̃ in clear, and study "
                                  "'two-checks' is a two-server study: it takes version 3")
    # The request is refused at its first bad record, and says which.
    reason, detail = why_refused(b"".join(body), STUDY, WINDOW, NOW_MS)
    assert (reason, detail.split(":")[0]) == (RejectReason.UNSUPPORTED_VERSION, "record 1")
    good = [body[0], body[8], body[9], body[10]]
    assert why_refused(b"".join(good), STUDY, WINDOW, NOW_MS) is None
    assert why_refused(b"".join(good + [body[0]]), STUDY, WINDOW, NOW_MS) == (
        RejectReason.DUPLICATE_RECORD,
        "record 4 has the record id of record 0: a request holds each record once")


def test_a_version_1_record_for_a_two_server_study_is_refused_as_the_wrong_kind():
    one = record(0, study=ONE_SERVER)
    for body in (one, one * 3):  # whatever its length says
        reason, detail = why_refused(body, STUDY, WINDOW, NOW_MS)
        assert reason is RejectReason.UNSUPPORTED_VERSION
        assert "'two-checks' is a two-server study: it takes version 3" in detail


def test_a_version_3_record_for_a_one_server_study_is_refused_as_the_wrong_kind():
    reason, detail = why_refused(record(0), ONE_SERVER, WINDOW, NOW_MS)
    assert reason is RejectReason.UNSUPPORTED_VERSION
    assert detail == ("record 0: version 3 is a two-server record, and study 'one-checks' is a "
                      "one-server study: it takes version 1")


def test_a_body_that_is_no_whole_number_of_version_3_records_is_refused_whole():
    assert why_refused(record(0)[:-1], STUDY, WINDOW, NOW_MS) == (
        RejectReason.UNDECODABLE, ("body length 243 is not a multiple of the record size 244 "
                                   "(100 + 16·L, L = d(d+3)/2 = 9, d=3)"))
    other_d = with_bytes(record(0) + b"\x00" * 16, D_BYTES.start, (4).to_bytes(4, "little"))
    assert why_refused(other_d, STUDY, WINDOW, NOW_MS) == (
        RejectReason.WRONG_DIMENSION, "record 0 has d=4, study 'two-checks' has d=3")
    assert why_refused(b"", STUDY, WINDOW, NOW_MS)[0] is RejectReason.UNDECODABLE


@pytest.mark.parametrize("k", [1, 2, 64])
def test_honest_devices_records_pass_one_or_many_to_a_request(k):
    body = b"".join(record(i) for i in range(k))
    assert why_refused(body, STUDY, WINDOW, NOW_MS) is None
    assert not check_records(body, STUDY, WINDOW, NOW_MS).any()
