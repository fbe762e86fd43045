"""The columnar fetch (aggregator/fetch.py) reads exactly what kafka-python's parser reads.

Batches built by kafka-python's own batch builder and batches a real broker served are parsed
both ways and compared record by record: offsets, values and headers, and the positions a
consumer moves to. Corrupted batches either raise as the library does or parse identically.
"""

from __future__ import annotations

import random
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka import TopicPartition
from kafka.errors import CorruptRecordError
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from aggregator import fetch
from aggregator.batch import Polled, decode_headers
from aggregator.fetch import parse_records
from ipdp.kafka_io import kafka_admin, kafka_consumer, kafka_producer

HEADER = 61  # a version-2 batch's fixed header; its records follow


def _build(records, codec: int = 0) -> bytes:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=False,
                                  producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                  batch_size=1 << 30)
    for offset, ts, key, value, headers in records:
        b.append(offset, ts, key, value, headers)
    return bytes(b.build())


def _mixed(n: int, seed: int) -> list:
    """Records whose layouts change often: sizes, keys, tombstones, headers, and offset and
    timestamp deltas that cross varint widths (64, 8192)."""
    rng = random.Random(seed)
    out, offset = [], 0
    for _ in range(n):
        offset += rng.choice([1, 1, 1, 2, 70])
        size = rng.choice([136, 136, 136, 0, 7, 300])
        value = None if rng.random() < 0.03 else bytes(rng.randrange(256) for _ in range(size))
        key = None if rng.random() < 0.8 else bytes(rng.randrange(6))
        headers = rng.choice([[("study", b"s1")], [("study", b"s1")], [],
                              [("a", None), ("bb", b"x" * 200)]])
        out.append((offset, 1_700_000_000_000 + rng.choice([0, 5, 100, 9000]), key, value,
                    headers))
    return out


def _library(raw: bytes) -> list:
    return [(r.offset, r.value, r.headers) for r in DefaultRecordBatch(raw)]


def _columnar(raw: bytes) -> list:
    batch = DefaultRecordBatch(raw)
    iter(batch)  # decompresses
    offsets, values, headers = parse_records(bytes(batch._buffer), batch._pos,
                                             batch.records_count, batch.base_offset)
    return list(zip(offsets.tolist(), values, [decode_headers(h) for h in headers], strict=True))


@pytest.mark.parametrize("codec", [0, 1], ids=["uncompressed", "gzip"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_parse_matches_the_library_on_mixed_batches(codec: int, seed: int) -> None:
    raw = _build(_mixed(2000, seed), codec)
    expected = _library(raw)
    assert len(expected) == 2000
    assert _columnar(raw) == expected


def test_parse_reads_a_uniform_batch_in_few_runs() -> None:
    """5,000 alike records: right answer, and the layout decoded in Python a handful of times."""
    raw = _build([(i, 1_700_000_000_000 + i // 10, None, i.to_bytes(4, "big") * 34,
                   [("study", b"bench")]) for i in range(5000)])
    calls = []
    real = fetch._template

    def counting(buf, pos):
        calls.append(pos)
        return real(buf, pos)

    fetch._template = counting
    try:
        got = _columnar(raw)
    finally:
        fetch._template = real
    assert got == _library(raw)
    # widths change at offset delta 64 and 8192 and timestamp delta 64 (ms 640): few templates
    assert len(calls) <= 6, len(calls)


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 10**6), flips=st.lists(
    st.tuples(st.integers(0, 10**9), st.integers(1, 255)), min_size=1, max_size=3))
def test_corrupted_records_raise_as_the_library_does_or_parse_identically(seed, flips) -> None:
    raw = bytearray(_build(_mixed(40, seed)))
    for where, xor in flips:
        raw[HEADER + where % (len(raw) - HEADER)] ^= xor
    raw = bytes(raw)
    try:
        expected = _library(raw)
    except CorruptRecordError:
        expected = None
    try:
        got = _columnar(raw)
    except CorruptRecordError:
        got = None
    if expected is not None and any(not 0 <= r[0] < 1 << 63 for r in expected):
        assert got is None  # the library hands out a negative offset; refused here
    elif expected is not None:
        assert got == expected
    elif got is not None:
        # The one thing the library checks eagerly and this parser lazily: header keys must be
        # UTF-8 (decode_headers replaces bad bytes when a rejected record's header is read).
        batch = DefaultRecordBatch(raw)
        iter(batch)
        _, _, blocks = parse_records(bytes(batch._buffer), batch._pos, batch.records_count,
                                     batch.base_offset)
        assert any("\ufffd" in k for b in blocks for k, _ in decode_headers(b))


def test_trailing_bytes_and_truncation_raise() -> None:
    raw = _build(_mixed(10, 7))
    batch = DefaultRecordBatch(raw)
    with pytest.raises(CorruptRecordError):
        parse_records(bytes(batch._buffer) + b"\0", batch._pos, batch.records_count,
                      batch.base_offset)
    with pytest.raises(CorruptRecordError):
        parse_records(bytes(batch._buffer)[:-3], batch._pos, batch.records_count,
                      batch.base_offset)


def _drain(consumer, max_records: int, want: int, columnar: bool) -> tuple[list, list]:
    """Every record polled (as (partition, offset, value, headers)) and the positions after
    each poll."""
    rows, positions = [], []
    idle = 0
    while len(rows) < want and idle < 40:
        polled = consumer.poll(timeout_ms=250, max_records=max_records)
        idle = 0 if polled else idle + 1
        if polled:
            # The columnar fetch hands over Polled chunks, kafka-python ConsumerRecords.
            assert all((type(recs[0]) is Polled) == columnar for recs in polled.values())
            batch = fetch.batch_of(polled)
            assert len(batch) <= max_records  # kafka-python counts a chunk by its records
            rows += zip(batch.partition.tolist(), batch.offset.tolist(), batch.values,
                        map(decode_headers, batch.headers), strict=True)
            positions.append({tp.partition: consumer.position(tp) for tp in
                              sorted(consumer.assignment())})
    return rows, positions


def test_a_real_broker_s_batches_read_the_same_both_ways(kafka_settings) -> None:
    """Plain and gzip producers, tombstones, headers, 2 partitions; read from the start and from
    the middle of a batch, in polls of 7 records and of 5,000."""
    from kafka.admin import NewTopic

    topic = f"ipdp.fetch.{uuid.uuid4().hex[:10]}"
    admin = kafka_admin(kafka_settings)
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    admin.close()
    records = _mixed(3000, 11)
    for codec in (None, "gzip"):
        producer = kafka_producer(kafka_settings, compression_type=codec)
        for i, (_, _, key, value, headers) in enumerate(records):
            # the producer takes neither a None header value nor a record without key and value
            headers = [(k, b"" if v is None else v) for k, v in headers]
            key = b"k" if key is None and value is None else key
            producer.send(topic, key=key, value=value, headers=headers, partition=i % 2)
        producer.flush()
        producer.close()
    total = 2 * len(records)
    for max_records, start in ((7, None), (5000, None), (5000, 1001)):
        results = []
        for columnar in (False, True):
            consumer = kafka_consumer(kafka_settings, group_id=None)
            if columnar:
                fetch.install(consumer)
            tps = [TopicPartition(topic, p) for p in (0, 1)]
            consumer.assign(tps)
            for tp in tps:
                if start is None:
                    consumer.seek_to_beginning(tp)
                else:
                    consumer.seek(tp, start)
            want = total if start is None else total - 2 * start
            results.append(_drain(consumer, max_records, want, columnar))
            consumer.close()
        (lib_rows, lib_pos), (col_rows, col_pos) = results
        assert len(lib_rows) == (total if start is None else total - 2 * start)
        assert col_rows == lib_rows
        if max_records == 7:  # small polls end mid-batch: positions must agree poll by poll
            assert col_pos == lib_pos


def test_install_refuses_read_committed(kafka_settings) -> None:
    consumer = kafka_consumer(kafka_settings, group_id=None, isolation_level="read_committed")
    try:
        with pytest.raises(fetch.UnsupportedKafkaClient, match="uncommitted"):
            fetch.install(consumer)
    finally:
        consumer.close()


def _zigzag(v: int) -> bytes:
    z, out = ((v << 1) ^ (v >> 63)) & ((1 << 64) - 1), bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    return bytes(out + bytes([z]))


def _hand_batch(base: int, offset_delta: int) -> bytes:
    """A CRC-valid version-2 batch of one record (value b"v"), written byte by byte."""
    import struct

    from kafka.record.util import calc_crc32c

    body = _zigzag(0) + _zigzag(0) + _zigzag(offset_delta) + _zigzag(-1) + _zigzag(1) + b"v" \
        + _zigzag(0)
    rest = struct.pack(">hiqqqhii", 0, 0, 1000, 1000, -1, -1, -1, 1) + _zigzag(len(body)) + body
    return struct.pack(">qiibI", base, 9 + len(rest), 0, 2, calc_crc32c(memoryview(rest))) + rest


def test_an_offset_delta_beyond_int32_or_an_offset_beyond_int64_is_corrupt() -> None:
    """kafka-python reads a 10-byte delta exactly; numpy would wrap it, so it is refused."""
    assert _columnar(_hand_batch(0, 5)) == [(5, b"v", [])] == _library(_hand_batch(0, 5))
    with pytest.raises(CorruptRecordError, match="offset delta"):
        _columnar(_hand_batch(0, 2**62))
    with pytest.raises(CorruptRecordError, match="offset"):
        _columnar(_hand_batch(2**63 - 2, 5))


def test_a_legacy_batch_checks_each_inner_message_crc() -> None:
    """Old-format (magic 1) gzip wrapper whose second inner message has a wrong CRC."""
    import struct

    from kafka.record.legacy_records import LegacyRecordBatchBuilder
    from kafka.record.memory_records import MemoryRecords

    b = LegacyRecordBatchBuilder(magic=1, compression_type=1, batch_size=1 << 30)
    for i in range(3):
        b.append(i, 1000, None, b"v%d" % i)
    inner = b._buffer
    second = 12 + struct.unpack_from(">i", inner, 8)[0]
    inner[second + 12] ^= 0xFF  # the second message's CRC, before compression
    raw = bytes(b.build())
    tp = TopicPartition("t", 0)
    for cls in (fetch.Fetcher.PartitionRecords, fetch.ColumnarRecords):
        part = cls(0, tp, MemoryRecords(raw), check_crcs=True)
        with pytest.raises(CorruptRecordError, match="crc"):
            part.take(10)  # the library delivers offset 0 first, then raises on the next take
            part.take(10)


def test_install_refuses_a_kafka_python_it_was_not_checked_against(kafka_settings,
                                                                    monkeypatch) -> None:
    import kafka

    consumer = kafka_consumer(kafka_settings, group_id=None)
    try:
        monkeypatch.setattr(kafka, "__version__", "3.1.0")
        with pytest.raises(fetch.UnsupportedKafkaClient, match="3.1.0"):
            fetch.install(consumer)
        assert consumer._fetcher.PartitionRecords is fetch.Fetcher.PartitionRecords
    finally:
        consumer.close()
