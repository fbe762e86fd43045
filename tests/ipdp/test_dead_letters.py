"""The dead-letter container: what the aggregator writes reads back record by record, split
into messages of at most the size asked, and the single-record form still reads."""

from __future__ import annotations

import numpy as np
import pytest

from ipdp.dead_letters import (
    DEAD_LETTERS_HEADER,
    ENTRY,
    dead_letter_headers,
    encode_dead_letters,
    read_dead_letters,
)

CAUSES = [("replayed", "record id already seen within the replay window"),
          ("undecodable", "value is None or not bytes-like — détail")]


def _read_all(containers, topic="t") -> list:
    return [x for _, value in containers
            for x in read_dead_letters(value, dead_letter_headers(topic))]


def test_refused_records_read_back_with_source_reason_and_bytes():
    values = [b"a" * 272, None, b"", b"b" * 80]
    containers = encode_dead_letters(
        np.array([0, 1, 1, 3]), np.array([5, 6, 6, 2**40]), np.array([-1, 0, 1, -1]),
        np.array([0, 1, 0, 0]), CAUSES, values, max_bytes=1 << 20)
    assert len(containers) == 1
    key, _ = containers[0]
    assert key == b"0:5"
    got = _read_all(containers, "records")
    assert [(x.topic, x.source, x.reason, x.detail, x.value) for x in got] == [
        ("records", "0:5", *CAUSES[0], b"a" * 272),
        ("records", "1:6#0", *CAUSES[1], b""),
        ("records", "1:6#1", *CAUSES[0], b""),
        ("records", f"3:{2**40}", *CAUSES[0], b"b" * 80),
    ]


def test_containers_stay_within_the_size_asked_and_leave_out_longer_records():
    k, size, limit = 100, 272, 4096
    values = [bytes([i]) * size for i in range(k)] + [b"x" * (limit + 1)]
    containers = encode_dead_letters(
        np.zeros(k + 1, np.int64), np.arange(k + 1), np.full(k + 1, -1), np.zeros(k + 1, np.int64),
        CAUSES[:1], values, max_bytes=limit)
    # 13 entries of 24 + 272 bytes fit in 4,096: 8 messages, the last with the 101st entry,
    # whose bytes are left out.
    assert (limit // (ENTRY.itemsize + size), len(containers)) == (13, 8)
    table = 1 + len(CAUSES[0][0]) + 2 + len(CAUSES[0][1].encode())
    assert all(len(value) - 12 - table <= limit for _, value in containers)
    got = _read_all(containers)
    assert [x.offset for x in got] == list(range(k + 1))
    assert [x.value for x in got] == values[:k] + [b""]


def test_a_single_record_dead_letter_still_reads():
    (x,) = read_dead_letters(b"\x01raw", [("reason", b"stale"), ("detail", b"old"),
                                          ("source", b"ipdp.records:2:17#3")])
    assert (x.topic, x.partition, x.offset, x.index, x.reason, x.detail, x.value) == (
        "ipdp.records", 2, 17, 3, "stale", "old", b"\x01raw")


def test_a_container_of_an_unknown_version_is_refused():
    (_, value), = encode_dead_letters(np.zeros(1), np.zeros(1), np.full(1, -1), np.zeros(1),
                                      CAUSES[:1], [b"r"], max_bytes=1 << 20)
    with pytest.raises(ValueError, match="version 2"):
        read_dead_letters(value, [(DEAD_LETTERS_HEADER, b"2"), ("topic", b"t")])


@pytest.mark.parametrize("change", ["truncated", "extended"])
def test_a_container_whose_entries_lengths_do_not_add_up_is_refused(change):
    (_, value), = encode_dead_letters(np.zeros(2), np.arange(2), np.full(2, -1), np.zeros(2),
                                      CAUSES[:1], [b"first", b"second"], max_bytes=1 << 20)
    broken = value[:-1] if change == "truncated" else value + b"!"
    with pytest.raises(ValueError) as refused:
        read_dead_letters(broken, dead_letter_headers("t"))
    assert str(refused.value) == "dead-letter container: the entries' lengths do not add up"


def test_an_empty_container_reads_as_no_records():
    value = bytes((1, 0, 0, 0)) + (0).to_bytes(4, "little") + (0).to_bytes(4, "little")
    assert read_dead_letters(value, dead_letter_headers("t")) == []


def test_a_detail_longer_than_its_two_length_bytes_is_cut_to_fit():
    causes = [("norm_out_of_bounds", "é" * 40_000)]  # 80,000 bytes of UTF-8
    containers = encode_dead_letters(np.zeros(1), np.zeros(1), np.full(1, -1), np.zeros(1),
                                     causes, [b"r"], max_bytes=1 << 20)
    (x,) = _read_all(containers)
    assert x.detail.encode()[:0xFFFE] == ("é" * 40_000).encode()[:0xFFFE]
    assert len(x.detail.encode("utf-8", "replace")) <= 0xFFFF + 2
    assert (x.reason, x.value) == ("norm_out_of_bounds", b"r")


def test_buffers_of_any_bytes_like_type_are_kept_and_other_values_left_empty():
    values = [bytearray(b"ab"), memoryview(b"cde"), None, 7, b"f"]
    containers = encode_dead_letters(np.zeros(5), np.arange(5), np.full(5, -1), np.zeros(5),
                                     CAUSES[:1], values, max_bytes=1 << 20)
    assert [x.value for x in _read_all(containers)] == [b"ab", b"cde", b"", b"", b"f"]


def test_a_container_is_keyed_by_its_first_records_source():
    containers = encode_dead_letters(np.array([1, 2]), np.array([6, 9]), np.array([0, -1]),
                                     np.zeros(2), CAUSES[:1], [b"a" * 100, b"b" * 100],
                                     max_bytes=130)
    assert [key for key, _ in containers] == [b"1:6#0", b"2:9"]


def test_a_container_whose_first_byte_is_another_version_is_refused():
    (_, value), = encode_dead_letters(np.zeros(1), np.zeros(1), np.full(1, -1), np.zeros(1),
                                      CAUSES[:1], [b"r"], max_bytes=1 << 20)
    with pytest.raises(ValueError) as refused:
        read_dead_letters(b"\x02" + value[1:], dead_letter_headers("t"))
    assert str(refused.value) == "dead-letter container version 1, supported: 1"


def test_a_single_record_dead_letter_without_an_index_and_without_a_value_reads():
    (x,) = read_dead_letters(None, [("reason", b"undecodable"), ("detail", b""),
                                    ("source", b"ipdp.records:0:5")])
    assert (x.topic, x.partition, x.offset, x.index, x.value, x.source) == (
        "ipdp.records", 0, 5, None, b"", "0:5")


def test_a_record_of_exactly_the_size_limit_is_kept_in_a_container_of_its_own():
    limit = 64
    values = [b"x" * limit, b"y" * (limit + 1), b"z"]
    containers = encode_dead_letters(np.zeros(3), np.arange(3), np.full(3, -1), np.zeros(3),
                                     CAUSES[:1], values, max_bytes=limit)
    assert [x.value for x in _read_all(containers)] == [b"x" * limit, b"", b"z"]
    assert len(containers) == 2  # the entry of the kept record already passes the limit


@pytest.mark.parametrize(("lengths", "containers"), [
    ((26, 26), 1),  # 50 + 50 bytes of entries and records: exactly the limit, one container
    ((30, 23), 2),  # 54 + 47 = 101: one byte over, the second record starts the next one
])
def test_a_container_is_cut_where_its_entries_and_bytes_would_pass_the_limit(lengths, containers):
    values = [b"r" * n for n in lengths]
    k = len(values)
    out = encode_dead_letters(np.zeros(k), np.arange(k), np.full(k, -1), np.zeros(k),
                              CAUSES[:1], values, max_bytes=100)
    assert len(out) == containers
    assert [x.value for x in _read_all(out)] == values


def test_a_container_s_reserved_header_bytes_are_zero():
    (_, value), = encode_dead_letters(np.zeros(1), np.zeros(1), np.full(1, -1), np.zeros(1),
                                      CAUSES[:1], [b"r"], max_bytes=1 << 20)
    assert value[:4] == bytes((1, 0, 0, 0))
