"""Tests for ipdp.wire at its edges: the exact messages and details a caller reads, the
boundaries of the record window, of max_size and of containers, inputs that are not float64
arrays, the study header, and the order decode_batch keeps."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from ipdp.wire import (
    MalformedRecord,
    RecordBatch,
    RecordWindow,
    RejectReason,
    container_of,
    decode_batch,
    decode_joined,
    decode_record,
    encode_batch,
    encode_container,
    encode_record,
    head_word,
    header_study,
    record_size,
    split_container,
    study_hash,
    study_headers,
)

SH = study_hash("study-at-the-edges")


def exactly(message: str) -> str:
    """A ``pytest.raises(match=...)`` pattern that only the whole of ``message`` matches."""
    return f"^{re.escape(message)}$"


def record(d: int, seed: int = 0, sh: bytes = SH) -> bytes:
    """One valid record of dimension d with seeded id, time and values."""
    rng = np.random.default_rng(seed)
    return encode_record(sh, rng.bytes(16), int(rng.integers(0, 2**40)),
                         rng.standard_normal(d), rng.standard_normal(d))


def triples(rejects) -> list[tuple[int, RejectReason, str]]:
    """(input index, reason, detail) of each reject."""
    return [(i, e.reason, e.detail) for i, e in rejects]


# --- what a refusal says -------------------------------------------------------------------


def test_malformed_record_args_and_repr_carry_its_detail():
    err = MalformedRecord(RejectReason.NON_FINITE, "q̃ holds NaN")
    assert err.args == (RejectReason.NON_FINITE, "q̃ holds NaN")
    assert "q̃ holds NaN" in repr(err)


def test_record_size_refusal_names_the_dimension():
    with pytest.raises(ValueError, match=exactly("d must be >= 1, got 0")):
        record_size(0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"study_hash": b"short"}, "study_hash must be 16 bytes, got 5"),
    ({"record_ids": np.zeros((2, 15), np.uint8)},
     "record_ids must be uint8 of shape (k, 16), got uint8 (2, 15)"),
    ({"created_ms": np.zeros(2)}, "created_ms must be integers of shape (2,), got float64 (2,)"),
    ({"q": np.zeros(2), "p": np.zeros(2)}, "q and p must both have shape (2, d >= 1), got (2,), (2,)"),
])
def test_encode_batch_refusal_says_which_argument_and_what_it_got(kwargs, message):
    args = {"study_hash": SH, "record_ids": np.zeros((2, 16), np.uint8),
            "created_ms": np.zeros(2, np.int64), "q": np.ones((2, 3)), "p": np.ones((2, 3))}
    with pytest.raises(ValueError, match=exactly(message)):
        encode_batch(**(args | kwargs))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"record_id": bytes(15)}, "record_id must be 16 bytes, got 15"),
    ({"created_ms": 2**63},
     "created_ms 9223372036854775808 does not fit in a signed 64-bit integer"),
    ({"q": np.zeros((1, 2)), "p": np.zeros((1, 2))},
     "q and p must be 1-D of the same length, got (1, 2), (1, 2)"),
    ({"p": [1.0, 2.0, 3.0]}, "q and p must be 1-D of the same length, got (2,), (3,)"),
])
def test_encode_record_refusal_says_which_argument_and_what_it_got(kwargs, message):
    args = {"study_hash": SH, "record_id": bytes(16), "created_ms": 0, "q": [1.0, 2.0],
            "p": [3.0, 4.0]}
    with pytest.raises(ValueError, match=exactly(message)):
        encode_record(**(args | kwargs))


def test_container_refusals_say_what_is_wrong():
    with pytest.raises(ValueError, match=exactly("a container holds at least one record")):
        encode_container([])
    with pytest.raises(ValueError, match=exactly(
            "a container's records must all have the same length (one d)")):
        encode_container([record(1), record(2)])
    with pytest.raises(ValueError, match=exactly("191 bytes are not k=2 records of one length")):
        container_of((record(3) * 2)[:-1], 2)
    with pytest.raises(ValueError, match=exactly("95 bytes are not records of 96 bytes (d=3)")):
        decode_joined(record(3)[:-1], 3)


def test_each_undecodable_value_gets_its_own_detail():
    values = [None, b"", "not bytes", record(14)[:100], record(2)]
    assert triples(decode_batch(values)[1]) == [
        (0, RejectReason.UNDECODABLE, "value is None or not bytes-like"),
        (1, RejectReason.UNDECODABLE, "value is empty"),
        (2, RejectReason.UNDECODABLE, "value is None or not bytes-like"),
        (3, RejectReason.UNDECODABLE, "length 100 is not 48 + 16·d for any d >= 1"),
    ]


def test_a_header_dimension_that_disagrees_with_the_length_names_both():
    buf = bytearray(record(14))
    buf[4:8] = struct.pack("<I", 13)
    with pytest.raises(MalformedRecord) as info:
        decode_record(bytes(buf))
    assert (info.value.reason, info.value.detail) == (
        RejectReason.UNDECODABLE, "header d=13 but length 272 implies d=14")


def test_a_head_word_that_equals_the_valid_one_only_as_a_float_is_refused():
    """Word 0 is compared bit for bit: the float64 whose value is head_word(1) has version byte
    0 and non-zero reserved bytes."""
    buf = struct.pack("<d", float(head_word(1))) + record(1)[8:]
    assert buf[0] == 0
    with pytest.raises(MalformedRecord) as info:
        decode_record(buf)
    assert (info.value.reason, info.value.detail) == (
        RejectReason.UNSUPPORTED_VERSION, "version 0, supported: 1")


# --- boundaries ----------------------------------------------------------------------------


def test_record_window_accepts_both_edges_and_refuses_one_millisecond_beyond():
    window = RecordWindow(replay_window_ms=1_000, max_future_skew_ms=50)
    now = 10_000
    created = np.array([8_999, 9_000, 10_050, 10_051])
    failures = window.failures(created, now)
    assert [(reason, detail) for _, reason, detail in failures] == [
        (RejectReason.STALE, "created before the replay window"),
        (RejectReason.FUTURE, "created too far in the future"),
    ]
    assert [hit.tolist() for hit, _, _ in failures] == [[True, False, False, False],
                                                        [False, False, False, True]]
    for ms in (9_000, 10_000, 10_050):
        assert not any(hit for hit, _, _ in window.failures(ms, now)), ms


def test_a_value_of_exactly_max_size_is_accepted_beside_values_of_other_lengths():
    good = record(14)
    batches, rejects = decode_batch([good, None, record(15)], max_size=len(good))
    assert [b.index.tolist() for b in batches] == [[0]]
    assert [(i, e.reason) for i, e in rejects] == [(1, RejectReason.UNDECODABLE),
                                                   (2, RejectReason.OVERSIZED)]


def test_a_container_of_one_record_holds_it_and_splits_back():
    one = record(3)
    value = container_of(one, 1)
    assert value == encode_container([one]) == bytes((2, 0, 0, 0, 1, 0, 0, 0)) + one
    assert split_container(value) == [one]


@pytest.mark.parametrize("first", [0, 1, 3, 255])
def test_a_value_whose_first_byte_is_not_2_is_not_split_even_when_its_count_adds_up(first):
    value = bytes((first, 0, 0, 0, 1, 0, 0, 0)) + record(1)
    assert split_container(value) is None


def test_records_back_to_back_that_are_all_refused_give_no_batch():
    bad = bytearray(record(2))
    bad[1] = 1  # reserved byte set
    batches, rejects = decode_joined(bytes(bad) * 3, 2)
    assert batches == []
    assert [(i, e.reason) for i, e in rejects] == [(i, RejectReason.UNDECODABLE) for i in range(3)]


# --- inputs that are not float64 arrays ----------------------------------------------------


def test_integer_and_list_inputs_encode_as_their_float64_values():
    rid = bytes(range(16))
    assert encode_record(SH, rid, 7, [1, -2], [3, 0]) == \
        encode_record(SH, rid, np.int64(7), np.array([1.0, -2.0]), np.array([3.0, 0.0]))
    rids = np.arange(32, dtype=np.uint8).reshape(2, 16)
    assert encode_batch(SH, rids, [5, -6], [[1, 2], [3, 4]], [[0, 1], [1, 0]]) == encode_batch(
        SH, rids, np.array([5, -6], np.int64), np.array([[1.0, 2.0], [3.0, 4.0]]),
        np.array([[0.0, 1.0], [1.0, 0.0]]))


@pytest.mark.parametrize("which", ["q", "p"])
@pytest.mark.parametrize("container", [list, np.asarray])
def test_complex_values_are_refused_not_cut_to_their_real_part(which, container):
    values = {"q": [1.0, 2.0], "p": [3.0, 4.0]}
    values[which] = [1.0 + 2.0j, 0.0]
    message = exactly(f"{which} must be real, got complex128")
    with pytest.raises(TypeError, match=message):
        encode_record(SH, bytes(16), 0, container(values["q"]), container(values["p"]))
    with pytest.raises(TypeError, match=message):
        encode_batch(SH, np.zeros((1, 16), np.uint8), [0], container([values["q"]]),
                     container([values["p"]]))


def test_float32_and_object_values_encode_as_their_float64_values():
    q32 = np.array([0.1, -3.5], np.float32)
    big = [2**70, -(2**64)]  # past int64: numpy holds them as Python ints (an object array)
    assert encode_record(SH, bytes(16), 0, q32, big) == encode_record(
        SH, bytes(16), 0, q32.astype(np.float64), [float(v) for v in big])


# --- the study header ----------------------------------------------------------------------


@pytest.mark.parametrize("study_id", ["study-1", "étude-42", ""])
def test_study_headers_round_trip_through_header_study(study_id):
    headers = study_headers(study_id)
    assert headers == [("study", study_id.encode("utf-8"))]
    assert header_study(headers) == study_id


@pytest.mark.parametrize(("headers", "study"), [
    (None, None),
    ([], None),
    ([("traceparent", b"00-abc")], None),
    ([("traceparent", b"00-abc"), ("study", b"s1")], "s1"),
    ([("study", None)], None),
    ([("study", None), ("study", b"s2")], "s2"),
    ([("study", bytearray(b"s3"))], "s3"),
    ([("study", memoryview(b"s4"))], "s4"),
])
def test_header_study_reads_the_first_study_header_with_a_value(headers, study):
    assert header_study(headers) == study


def test_header_study_replaces_bytes_that_are_not_utf8():
    assert header_study([("study", b"caf\xe9")]) == "caf\ufffd"


# --- take -----------------------------------------------------------------------------------


def test_take_keeps_study_hash_and_norms_of_the_selected_rows():
    hashes = [study_hash(f"study-{s}") for s in range(5)]
    b = decode_batch([record(4, s, hashes[s]) for s in range(5)])[0][0]
    for sel, rows in (([4, 0], [4, 0]), (np.array([False, True, False, True, False]), [1, 3])):
        taken = b.take(sel)
        assert [h.tobytes() for h in taken.study_hash] == [hashes[r] for r in rows]
        assert taken.sq_q.tolist() == b.sq_q[rows].tolist()
        assert taken.sq_p.tolist() == b.sq_p[rows].tolist()


def test_take_of_a_batch_without_norms_has_none():
    b = decode_batch([record(2, s) for s in range(3)])[0][0]
    bare = RecordBatch(d=b.d, index=b.index, study_hash=b.study_hash, record_id=b.record_id,
                       created_ms=b.created_ms, q=b.q, p=b.p)
    taken = bare.take([2, 0])
    assert (taken.sq_q, taken.sq_p) == (None, None)
    assert taken.index.tolist() == [2, 0]


# --- order ----------------------------------------------------------------------------------


def test_decode_batch_keeps_input_order_within_each_dimension_and_among_rejects():
    rng = np.random.default_rng(3)
    kinds = rng.integers(0, 6, 1_000)
    makers = [lambda i: record(2, i), lambda i: bytearray(record(3, i)),
              lambda i: memoryview(record(2, i)), lambda _: None, lambda i: record(3, i)[:70],
              lambda i: record(5, i)]
    values = [makers[k](i) for i, k in enumerate(kinds.tolist())]
    batches, rejects = decode_batch(values)
    by_d = {b.d: b for b in batches}
    assert by_d[2].index.tolist() == np.flatnonzero(np.isin(kinds, [0, 2])).tolist()
    assert by_d[3].index.tolist() == np.flatnonzero(kinds == 1).tolist()
    assert by_d[5].index.tolist() == np.flatnonzero(kinds == 5).tolist()
    assert [i for i, _ in rejects] == np.flatnonzero(np.isin(kinds, [3, 4])).tolist()
    for b in batches:
        ids = [bytes(values[i][24:40]) for i in b.index.tolist()]
        assert [r.tobytes() for r in b.record_id] == ids


def test_memoryviews_of_wider_items_decode_by_their_bytes():
    """A uint16 view of a d=5 record has 64 items, the byte length of a d=1 record."""
    records = [record(5, s) for s in range(3)]
    views = [memoryview(np.frombuffer(r, np.uint16)) for r in records]
    assert len(views[0]) == record_size(1)
    got, got_rejects = decode_batch(views)
    want, _ = decode_batch(records)
    assert got_rejects == [] and [b.d for b in got] == [5]
    for name in ("index", "record_id", "created_ms", "q", "p"):
        assert np.array_equal(getattr(got[0], name), getattr(want[0], name)), name


def test_rejects_of_values_of_one_length_come_in_input_order():
    values = [record(3, s) for s in range(5)]
    values[1] = b"\x07" + values[1][1:]  # version: the first check
    values[3] = values[3][:-8] + struct.pack("<d", float("nan"))  # non-finite: the last
    assert [(i, e.reason) for i, e in decode_batch(values)[1]] == [
        (1, RejectReason.UNSUPPORTED_VERSION), (3, RejectReason.NON_FINITE)]


# --- details of a record's own faults, and values that are not flat byte buffers --------------


@pytest.mark.parametrize(("offset", "shown"), [(1, "010000"), (2, "000100"), (3, "000001")])
def test_a_reserved_byte_set_is_named_in_the_order_it_was_sent(offset, shown):
    # The detail shows the three reserved bytes as sent (little-endian, six hex digits), so an
    # operator reading a dead letter sees which byte a device set.
    buf = bytearray(record(2))
    buf[offset] = 1
    _, rejects = decode_batch([bytes(buf)])
    assert triples(rejects) == [(0, RejectReason.UNDECODABLE,
                                 f"reserved bytes {shown} are not zero")]


def test_a_non_finite_value_is_refused_with_its_detail():
    buf = bytearray(record(2))
    struct.pack_into("<d", buf, len(buf) - 8, float("nan"))
    _, rejects = decode_batch([bytes(buf)])
    assert triples(rejects) == [(0, RejectReason.NON_FINITE, "q̃ or p̃ holds NaN or Inf")]


def test_a_value_that_is_a_two_dimensional_byte_array_decodes_as_its_bytes():
    # A consumer may hand over any bytes-like value: a 2-D uint8 array counts by its bytes,
    # not by its rows.
    values = [record(3, seed) for seed in range(3)]
    shaped = [np.frombuffer(v, np.uint8).reshape(-1, 8) for v in values]
    expected, none = decode_batch(values)
    got, rejects = decode_batch(shaped)
    assert none == [] and rejects == [] and len(got) == len(expected) == 1
    assert got[0].record_id.tobytes() == expected[0].record_id.tobytes()
    assert np.array_equal(got[0].q, expected[0].q) and np.array_equal(got[0].p, expected[0].p)
