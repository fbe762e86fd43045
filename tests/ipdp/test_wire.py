"""Tests for ipdp.wire: layout, round trips, reject reasons and fuzzing of the decoders."""

from __future__ import annotations

import hashlib
import pickle
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipdp.wire import (
    CREATED_MS_BYTES,
    CREATED_MS_WORD,
    D_BYTES,
    HEAD_WORD,
    HEAD_WORD_BYTES,
    HEADER_SIZE,
    RECORD_ID_BYTES,
    RECORD_ID_WORDS,
    RESERVED_BYTES,
    STUDY_HASH_BYTES,
    STUDY_HASH_WORDS,
    STUDY_HEAD_BYTES,
    VALUES_OFFSET,
    VALUES_WORD,
    VERSION_BYTE,
    WIRE_VERSION,
    MalformedRecord,
    Record,
    RecordBatch,
    RejectReason,
    container_count,
    decode_batch,
    decode_record,
    encode_batch,
    encode_container,
    encode_record,
    head_word,
    record_size,
    study_hash,
)

I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
SH = study_hash("study-under-test")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_arrays(rng: np.random.Generator, k: int, d: int):
    """Return random record_ids, created_ms, q and p for k records of dimension d."""
    rid = rng.integers(0, 256, size=(k, 16), dtype=np.uint8)
    ms = rng.integers(I64_MIN, I64_MAX, size=k, dtype=np.int64, endpoint=True)
    q = rng.standard_normal((k, d)) * 10.0 ** rng.integers(-300, 300, size=(k, d))
    p = rng.standard_normal((k, d))
    return rid, ms, q, p


def valid(d: int = 14, seed: int = 0) -> bytes:
    """Return one valid encoded record of dimension d."""
    rid, ms, q, p = make_arrays(np.random.default_rng(seed), 1, d)
    return encode_record(SH, rid[0].tobytes(), int(ms[0]), q[0], p[0])


def patched(buf: bytes, offset: int, data: bytes) -> bytes:
    """Return buf with data written at offset."""
    out = bytearray(buf)
    out[offset : offset + len(data)] = data
    return bytes(out)


def bits(a: np.ndarray) -> np.ndarray:
    """Return the raw uint64 bit patterns of a float64 array."""
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def reason_of(value, max_size=None) -> RejectReason:
    """Return the reason decode_record gives for value."""
    with pytest.raises(MalformedRecord) as info:
        decode_record(value, max_size)
    return info.value.reason


def all_indices(batches: list[RecordBatch], rejects) -> list[int]:
    """Return every accepted and rejected input index, in one list."""
    accepted = [i for b in batches for i in b.index.tolist()]
    return accepted + [i for i, _ in rejects]


# --- layout -------------------------------------------------------------------------------


def test_record_size_at_d14_is_272():
    assert record_size(14) == 272
    assert record_size(1) == HEADER_SIZE + 16
    assert len(valid(14)) == 272


def test_record_size_rejects_dimension_below_one():
    with pytest.raises(ValueError):
        record_size(0)


def test_study_hash_is_first_16_bytes_of_sha256_of_the_utf8_study_text():
    text = '{"study_id":"étude-42"}'
    assert study_hash(text) == hashlib.sha256(text.encode("utf-8")).digest()[:16]
    assert len(study_hash("")) == 16


def test_header_fields_sit_at_the_documented_offsets():
    rid = bytes(range(16))
    buf = encode_record(SH, rid, -5, [1.5, -2.0], [0.25, 3.0])
    version, reserved, d = struct.unpack_from("<B3sI", buf, 0)
    assert (version, reserved, d) == (WIRE_VERSION, b"\0\0\0", 2)
    assert buf[8:24] == SH
    assert buf[24:40] == rid
    assert struct.unpack_from("<q", buf, 40) == (-5,)
    assert struct.unpack_from("<4d", buf, 48) == (1.5, -2.0, 0.25, 3.0)
    assert len(buf) == record_size(2)
    # The names every reader of raw records slices with say the same.
    assert (buf[VERSION_BYTE], buf[RESERVED_BYTES], buf[D_BYTES]) == (WIRE_VERSION, b"\0" * 3,
                                                                        (2).to_bytes(4, "little"))
    assert (buf[STUDY_HASH_BYTES], buf[RECORD_ID_BYTES]) == (SH, rid)
    assert int.from_bytes(buf[CREATED_MS_BYTES], "little", signed=True) == -5
    assert buf[STUDY_HEAD_BYTES] == buf[VERSION_BYTE:STUDY_HASH_BYTES.stop]
    assert np.frombuffer(buf, "<f8", offset=VALUES_OFFSET).tolist() == [1.5, -2.0, 0.25, 3.0]
    words = np.frombuffer(buf, "<u8")
    assert int(words[HEAD_WORD]) == head_word(2) == int.from_bytes(buf[HEAD_WORD_BYTES], "little")
    assert words[STUDY_HASH_WORDS].tobytes() == SH and words[RECORD_ID_WORDS].tobytes() == rid
    assert int(words[CREATED_MS_WORD].view("<i8")) == -5
    assert words[VALUES_WORD:].view("<f8").tolist() == [1.5, -2.0, 0.25, 3.0]
    assert container_count(encode_container([buf] * 3)) == 3


def test_reject_reason_values_are_the_dead_letter_strings():
    assert {r.value for r in RejectReason} == {
        "undecodable",
        "unsupported_version",
        "wrong_dimension",
        "non_finite",
        "norm_out_of_bounds",
        "unknown_study",
        "study_mismatch",
        "untrusted_study",
        "closed_study",
        "replayed",
        "stale",
        "future",
        "oversized",
        "credential_missing",
        "credential_invalid",
        "credential_untrusted",
        "credential_expired",
        "credential_wrong_study",
        "credential_bad_slot",
        "credential_reused",
        "helper_refused",
        "duplicate_record",
        "too_large",
        "unsupported_media_type",
        "rate_limited",
        "kafka_unavailable",
        "studies_unavailable",
        "not_ready",
        "not_found",
        "method_not_allowed",
        "bad_request",
    }
    assert RejectReason.STALE == "stale"


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 14, 100])
@pytest.mark.parametrize("created_ms", [I64_MIN, -1, 0, 1_700_000_000_000, I64_MAX])
def test_single_record_round_trips_bit_exactly(d, created_ms):
    rng = np.random.default_rng(d)
    rid, _, q, p = make_arrays(rng, 1, d)
    q[0, 0] = -0.0
    p[0, -1] = 5e-324
    buf = encode_record(SH, rid[0].tobytes(), created_ms, q[0], p[0])
    rec = decode_record(buf)
    assert isinstance(rec, Record)
    assert rec.study_hash == SH
    assert rec.record_id == rid[0].tobytes()
    assert rec.created_ms == created_ms and type(rec.created_ms) is int
    assert rec.q.dtype == np.float64 and rec.q.shape == (d,)
    assert np.array_equal(bits(rec.q), bits(q[0]))
    assert np.array_equal(bits(rec.p), bits(p[0]))
    assert np.signbit(rec.q[0])


@pytest.mark.parametrize("d", [1, 14, 100])
def test_batch_round_trips_bit_exactly(d):
    rng = np.random.default_rng(100 + d)
    k = 257
    rid, ms, q, p = make_arrays(rng, k, d)
    ms[:2] = [I64_MIN, I64_MAX]
    q[3] = -0.0
    values = encode_batch(SH, rid, ms, q, p)
    batches, rejects = decode_batch(values)
    assert rejects == []
    assert len(batches) == 1
    b = batches[0]
    assert b.d == d and len(b) == k
    assert np.array_equal(b.index, np.arange(k))
    assert np.array_equal(b.study_hash, np.tile(np.frombuffer(SH, np.uint8), (k, 1)))
    assert np.array_equal(b.record_id, rid)
    assert np.array_equal(b.created_ms, ms)
    assert np.array_equal(bits(b.q), bits(q))
    assert np.array_equal(bits(b.p), bits(p))


@pytest.mark.parametrize("d", [1, 14, 100])
def test_encode_batch_equals_encode_record_byte_for_byte(d):
    rid, ms, q, p = make_arrays(np.random.default_rng(200 + d), 50, d)
    batch = encode_batch(SH, rid, ms, q, p)
    single = [encode_record(SH, rid[i].tobytes(), int(ms[i]), q[i], p[i]) for i in range(50)]
    assert batch == single
    assert all(type(v) is bytes and len(v) == record_size(d) for v in batch)


def test_encode_batch_of_zero_records_is_empty():
    assert (
        encode_batch(
            SH,
            np.zeros((0, 16), np.uint8),
            np.zeros(0, np.int64),
            np.zeros((0, 3)),
            np.zeros((0, 3)),
        )
        == []
    )


def test_decoded_arrays_are_writeable_native_and_c_contiguous():
    b = decode_batch([valid(5, 1), valid(5, 2)])[0][0]
    for name in ("index", "study_hash", "record_id", "created_ms", "q", "p"):
        a = getattr(b, name)
        assert a.flags.writeable and a.flags.c_contiguous, name
        assert a.dtype.isnative, name
    assert (b.index.dtype, b.created_ms.dtype, b.q.dtype) == (np.int64, np.int64, np.float64)
    assert b.study_hash.dtype == np.uint8 and b.study_hash.shape == (2, 16)
    rec = decode_record(valid(5))
    assert rec.q.flags.writeable and rec.q.flags.c_contiguous
    rec.q[0] = 1.0


def test_bytearray_and_memoryview_values_decode_like_bytes():
    buf = valid(3)
    ref = decode_record(buf)
    wide = memoryview(np.frombuffer(buf, dtype=np.float64))
    batches, rejects = decode_batch([bytearray(buf), memoryview(buf), wide, memoryview(buf)[::1]])
    assert rejects == []
    assert np.array_equal(batches[0].index, [0, 1, 2, 3])
    assert all(np.array_equal(row, ref.q) for row in batches[0].q)
    assert np.array_equal(decode_record(bytearray(buf)).p, ref.p)


def test_take_selects_rows_by_mask_and_by_indices():
    values = [valid(4, s) for s in range(5)]
    b = decode_batch(values)[0][0]
    by_mask = b.take(np.array([True, False, True, False, False]))
    by_idx = b.take([4, 0])
    assert np.array_equal(by_mask.index, [0, 2]) and by_mask.d == 4
    assert np.array_equal(by_idx.index, [4, 0])
    assert np.array_equal(by_idx.q, b.q[[4, 0]])
    assert np.array_equal(by_idx.record_id, b.record_id[[4, 0]])
    assert len(b.take(np.zeros(5, bool))) == 0


def test_empty_input_gives_no_batches_and_no_rejects():
    assert decode_batch([]) == ([], [])


def test_record_of_exactly_max_size_is_accepted():
    buf = valid(14)
    assert decode_record(buf, max_size=len(buf)).q.shape == (14,)


# --- malformed records ---------------------------------------------------------------------

GOOD = valid(14)
NAN = struct.pack("<d", float("nan"))
INF = struct.pack("<d", float("inf"))
NINF = struct.pack("<d", float("-inf"))

MALFORMED = {
    "truncated": (GOOD[:-1], RejectReason.UNDECODABLE),
    "one_byte_too_long": (GOOD + b"\0", RejectReason.UNDECODABLE),
    "shorter_than_header": (GOOD[:47], RejectReason.UNDECODABLE),
    "header_only_with_d_zero": (patched(GOOD[:48], 4, b"\0\0\0\0"), RejectReason.UNDECODABLE),
    "empty": (b"", RejectReason.UNDECODABLE),
    "tombstone": (None, RejectReason.UNDECODABLE),
    "not_bytes_like": ("not bytes", RejectReason.UNDECODABLE),
    "version_2": (patched(GOOD, 0, b"\x02"), RejectReason.UNSUPPORTED_VERSION),
    "version_0": (patched(GOOD, 0, b"\x00"), RejectReason.UNSUPPORTED_VERSION),
    "version_2_with_odd_length": (b"\x02" + GOOD[1:-3], RejectReason.UNSUPPORTED_VERSION),
    "single_byte_version_2": (b"\x02", RejectReason.UNSUPPORTED_VERSION),
    "reserved_byte_1": (patched(GOOD, 1, b"\x01"), RejectReason.UNDECODABLE),
    "reserved_byte_3": (patched(GOOD, 3, b"\x80"), RejectReason.UNDECODABLE),
    "header_d_mismatch": (patched(GOOD, 4, struct.pack("<I", 13)), RejectReason.UNDECODABLE),
    "header_d_huge": (patched(GOOD, 4, b"\xff\xff\xff\xff"), RejectReason.UNDECODABLE),
    "nan_in_q": (patched(GOOD, 48, NAN), RejectReason.NON_FINITE),
    "inf_in_p": (patched(GOOD, 48 + 8 * 14, INF), RejectReason.NON_FINITE),
    "minus_inf_last_p": (patched(GOOD, 272 - 8, NINF), RejectReason.NON_FINITE),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_record_raises_with_its_reason(name):
    value, reason = MALFORMED[name]
    assert reason_of(value) is reason


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_decode_batch_rejects_malformed_value_at_its_index_and_keeps_good_rows(name):
    value, reason = MALFORMED[name]
    values = [valid(14, 1), value, valid(14, 2)]
    batches, rejects = decode_batch(values)
    assert [(i, e.reason) for i, e in rejects] == [(1, reason)]
    assert len(batches) == 1 and np.array_equal(batches[0].index, [0, 2])


def test_oversized_is_checked_before_everything_else():
    assert reason_of(GOOD, max_size=271) is RejectReason.OVERSIZED
    assert reason_of(patched(GOOD, 0, b"\x07"), max_size=100) is RejectReason.OVERSIZED
    assert reason_of(GOOD[:-1], max_size=100) is RejectReason.OVERSIZED
    assert reason_of(patched(GOOD, 48, NAN), max_size=271) is RejectReason.OVERSIZED


def test_unsupported_version_beats_reserved_dimension_and_non_finite():
    buf = patched(patched(patched(GOOD, 48, NAN), 1, b"\x01\x01\x01"), 4, b"\x09\0\0\0")
    assert reason_of(patched(buf, 0, b"\x02")) is RejectReason.UNSUPPORTED_VERSION


def test_non_zero_reserved_beats_dimension_mismatch_and_non_finite():
    err = pytest.raises(MalformedRecord, decode_record, patched(patched(GOOD, 48, NAN), 2, b"\x01"))
    assert err.value.reason is RejectReason.UNDECODABLE and "reserved" in err.value.detail
    err = pytest.raises(MalformedRecord, decode_record, patched(patched(GOOD, 48, NAN), 4, b"\x03"))
    assert err.value.reason is RejectReason.UNDECODABLE and "d=3" in err.value.detail


def test_finite_values_whose_square_overflows_decode_and_carry_an_infinite_norm():
    big = struct.pack("<d", 1e200)
    (batch,), rejects = decode_batch([patched(GOOD, 48, big), GOOD])
    assert rejects == [] and batch.q[0, 0] == 1e200
    assert np.isinf(batch.sq_q[0]) and np.isfinite(batch.sq_q[1])
    np.testing.assert_allclose(batch.sq_p, np.einsum("ij,ij->i", batch.p, batch.p))


def test_only_the_non_finite_row_of_a_batch_is_rejected():
    values = [valid(14, s) for s in range(4)]
    values[2] = patched(values[2], 48 + 8 * 14, NAN)
    (batch,), rejects = decode_batch(values)
    assert [(i, e.reason) for i, e in rejects] == [(2, RejectReason.NON_FINITE)]
    assert batch.index.tolist() == [0, 1, 3]
    assert batch.record_id.tobytes() == b"".join(values[i][24:40] for i in (0, 1, 3))


def test_mixed_batch_splits_by_dimension_and_lists_every_reject_by_input_index():
    good14 = [valid(14, s) for s in range(3)]
    good3 = [valid(3, s) for s in range(2)]
    values = [
        good14[0],  # 0
        None,  # 1
        good3[0],  # 2
        patched(good14[1], 0, b"\x02"),  # 3
        good14[1],  # 4
        patched(good3[1], 56, NAN),  # 5
        good14[2][:100],  # 6
        good3[1],  # 7
        good14[2] + bytes(16),  # 8 well-formed length for d=15, header says 14
        good14[2],  # 9
        valid(200),  # 10 too big
    ]
    batches, rejects = decode_batch(values, max_size=2000)
    rejects_by_index = {i: e.reason for i, e in rejects}
    assert [i for i, _ in rejects] == sorted(rejects_by_index)
    assert rejects_by_index == {
        1: RejectReason.UNDECODABLE,
        3: RejectReason.UNSUPPORTED_VERSION,
        5: RejectReason.NON_FINITE,
        6: RejectReason.UNDECODABLE,
        8: RejectReason.UNDECODABLE,
        10: RejectReason.OVERSIZED,
    }
    by_d = {b.d: b for b in batches}
    assert sorted(by_d) == [3, 14]
    assert np.array_equal(by_d[14].index, [0, 4, 9])
    assert np.array_equal(by_d[3].index, [2, 7])
    for b in batches:
        for row, i in enumerate(b.index.tolist()):
            rec = decode_record(values[i])
            assert np.array_equal(bits(b.q[row]), bits(rec.q))
            assert np.array_equal(bits(b.p[row]), bits(rec.p))
            assert b.record_id[row].tobytes() == rec.record_id
            assert int(b.created_ms[row]) == rec.created_ms


def test_malformed_record_is_a_readable_picklable_value_error():
    err = MalformedRecord(RejectReason.NON_FINITE, "q̃ holds NaN")
    assert isinstance(err, ValueError)
    assert str(err) == "non_finite: q̃ holds NaN"
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.reason, copy.detail) == (err.reason, err.detail)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"study_hash": b"short"},
        {"record_id": bytes(15)},
        {"created_ms": 2**63},
        {"created_ms": 1.5},
        {"q": np.zeros(3)},
        {"q": np.zeros((1, 2)), "p": np.zeros((1, 2))},
        {"q": [], "p": []},
    ],
)
def test_encode_record_rejects_malformed_arguments(kwargs):
    args = {
        "study_hash": SH,
        "record_id": bytes(16),
        "created_ms": 0,
        "q": [1.0, 2.0],
        "p": [3.0, 4.0],
    }
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError)):
        encode_record(**args)


def test_encode_batch_rejects_wrong_dtypes_and_shapes():
    rid, ms, q, p = make_arrays(np.random.default_rng(7), 2, 3)
    with pytest.raises(ValueError):
        encode_batch(SH, rid.astype(np.int64), ms, q, p)
    with pytest.raises(ValueError):
        encode_batch(SH, rid, ms.astype(np.float64), q, p)
    with pytest.raises(ValueError):
        encode_batch(SH, rid, ms.astype(np.uint64), q, p)
    with pytest.raises(ValueError):
        encode_batch(SH, rid, ms, q, p[:, :2])
    with pytest.raises(ValueError):
        encode_batch(SH, rid[:1], ms, q, p)


# --- fuzzing -------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=400), st.none() | st.integers(0, 500))
def test_arbitrary_bytes_raise_only_malformed_record(data, max_size):
    try:
        rec = decode_record(data, max_size)
    except MalformedRecord as err:
        assert isinstance(err.reason, RejectReason)
    else:
        assert len(data) == record_size(rec.q.shape[0])


values_strategy = st.lists(
    st.one_of(
        st.binary(max_size=120),
        st.none(),
        st.integers(1, 4).map(valid),
        st.tuples(st.integers(1, 4), st.integers(0, 2**32 - 1)).map(
            lambda t: (
                b"\x01\0\0\0"
                + struct.pack("<I", t[0])
                + t[1].to_bytes(4, "little") * 10
                + bytes(16 * t[0])
            )
        ),
    ),
    max_size=30,
)


@FUZZ
@given(values_strategy, st.none() | st.integers(0, 200))
def test_decode_batch_accounts_for_every_input_index_exactly_once(values, max_size):
    batches, rejects = decode_batch(values, max_size)
    seen = all_indices(batches, rejects)
    assert sorted(seen) == list(range(len(values)))
    assert len({b.d for b in batches}) == len(batches)
    for i, err in rejects:
        assert reason_of(values[i], max_size) is err.reason
    for b in batches:
        assert len(b) > 0
        assert b.q.shape == b.p.shape == (len(b), b.d)
        for row, i in enumerate(b.index.tolist()):
            assert np.array_equal(bits(b.q[row]), bits(decode_record(values[i], max_size).q))


@FUZZ
@given(st.integers(1, 6), st.data())
def test_single_byte_mutation_is_decoded_or_rejected_for_the_right_reason(d, data):
    buf = valid(d, seed=d)
    pos = data.draw(st.integers(0, len(buf) - 1), label="pos")
    new = data.draw(st.integers(0, 255).filter(lambda v: v != buf[pos]), label="byte")
    mutated = patched(buf, pos, bytes([new]))
    batches, rejects = decode_batch([mutated])
    if pos == 0:
        expected = RejectReason.UNSUPPORTED_VERSION
    elif pos < 8:
        expected = RejectReason.UNDECODABLE
    elif pos < HEADER_SIZE:
        expected = None
    else:
        floats = np.frombuffer(mutated, dtype="<f8", offset=HEADER_SIZE)
        expected = None if np.isfinite(floats).all() else RejectReason.NON_FINITE
    if expected is None:
        assert rejects == [] and batches[0].index.tolist() == [0]
        rec = decode_record(mutated)
        assert rec.study_hash + rec.record_id + struct.pack("<q", rec.created_ms) == mutated[8:48]
        assert rec.q.tobytes() + rec.p.tobytes() == mutated[HEADER_SIZE:]
    else:
        assert batches == [] and [(i, e.reason) for i, e in rejects] == [(0, expected)]
        assert reason_of(mutated) is expected


def test_a_container_holds_the_devices_bytes_unchanged_and_splits_back():
    from ipdp.wire import encode_container, split_container

    rid, ms, q, p = make_arrays(np.random.default_rng(11), 3, 4)
    records = encode_batch(b"\x01" * 16, rid, ms, q, p)
    value = encode_container(records)
    assert value[:8] == bytes((2, 0, 0, 0, 3, 0, 0, 0))
    assert split_container(value) == records
    assert split_container(records[0]) is None  # a single record is not a container


def test_records_back_to_back_decode_and_contain_as_their_slices_would():
    from ipdp.wire import container_of, decode_joined, encode_container, split_container

    rid, ms, q, p = make_arrays(np.random.default_rng(12), 5, 3)
    records = encode_batch(b"\x01" * 16, rid, ms, q, p)
    records[3] = patched(records[3], 1, b"\x01")  # reserved byte set
    joined = b"".join(records)
    got, rejects = decode_joined(joined, 3)
    want, want_rejects = decode_batch(records)
    assert [(i, e.reason, e.detail) for i, e in rejects] == \
        [(i, e.reason, e.detail) for i, e in want_rejects]
    for name in ("index", "study_hash", "record_id", "created_ms", "q", "p"):
        assert np.array_equal(getattr(got[0], name), getattr(want[0], name)), name
    assert container_of(joined, 5) == encode_container(records)
    assert split_container(container_of(memoryview(joined)[:2 * len(records[0])], 2)) == \
        records[:2]
    with pytest.raises(ValueError):
        container_of(joined[:-1], 5)
    with pytest.raises(ValueError):
        decode_joined(joined[:-1], 3)


def test_a_container_of_version_3_records_splits_back_to_the_devices_bytes():
    from ipdp.two_server_wire import two_server_record_size
    from ipdp.wire import container_of, is_record_size, split_container
    from producer.contributor import perturb_records
    from tests.ipdp.test_two_server_wire import rows, two_server_study

    study = two_server_study(d=3, n=1000)
    rng = np.random.default_rng(13)
    _, records = perturb_records(study, *rows(4, 3, seed=13), rng, grid_generator=rng,
                                 random_bytes=rng.bytes)
    assert split_container(container_of(b"".join(records), 4)) == records
    # Every length below a bound that is a record size is one of the two versions' sizes.
    bound = two_server_record_size(60)
    sizes = {record_size(d) for d in range(1, bound // 16)} | {
        two_server_record_size(d) for d in range(1, 60)}
    assert [s for s in range(bound) if is_record_size(s)] == sorted(s for s in sizes
                                                                   if s < bound)
    # 4 records of 243 bytes: no version's record size.
    assert split_container(container_of(b"x" * 972, 4)) is None


@pytest.mark.parametrize("value", [bytes((2, 0, 0, 0, 0, 0, 0, 0)),  # zero records
                                   bytes((2, 0, 0, 0, 3, 0, 0, 0)) + b"x" * 10,  # 10 % 3 != 0
                                   bytes((2, 1, 0, 0, 1, 0, 0, 0)) + b"x" * 80,  # reserved set
                                   bytes((2, 0, 0))])
def test_a_malformed_container_is_not_split(value):
    from ipdp.wire import split_container

    assert split_container(value) is None


def test_a_container_refuses_records_of_different_lengths():
    from ipdp.wire import encode_container

    with pytest.raises(ValueError, match="same length"):
        encode_container([b"a" * 80, b"b" * 96])


def test_the_wire_format_page_example_is_what_the_code_produces():
    """docs/wire-format.md's canonical text and hex dump, recomputed from the code."""
    import re
    import uuid
    from pathlib import Path

    from ipdp.study import Study

    page = (Path(__file__).resolve().parents[2] / "docs" / "wire-format.md").read_text()
    study = Study(study_id="example-study", d=2, n=1000, epsilon=1, delta=0.01)
    text = re.search(r"whose canonical text is\n\n```\n(.*?)\n```", page, re.DOTALL)[1]
    assert text == study.canonical_text
    dump = re.search(r"as produced by `encode_record`:\n\n```\n(.*?)\n```", page, re.DOTALL)[1]
    shown = bytes.fromhex("".join(line[10:].replace(" ", "") for line in dump.splitlines()))
    assert shown == encode_record(study.hash, uuid.UUID("3f2a9c1e-7b4d-4e8a-9c21-5d6e7f801a2b").bytes,
                                  1_700_000_000_000, [0.5, -1.25], [1.0, -0.0])
