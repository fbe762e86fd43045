"""Columnar fetch: Kafka record batches parsed as arrays, not one Python object per record.

kafka-python parses every fetched record in Python (a varint at a time) and builds a
``ConsumerRecord`` for it: most of a bare consumer's CPU per record (docs/benchmarks.md,
"Throughput and cost"). The aggregator needs three things per record: its offset, its value and,
for the rare rejected record, its headers. :class:`ColumnarRecords` replaces kafka-python's
per-partition record iterator (``Fetcher.PartitionRecords``) in the aggregator's consumer, and
nothing else: group membership, fetch requests, positions, pauses, seeks and fetch errors stay
kafka-python's. A poll then returns, per partition, :class:`~aggregator.batch.Polled` chunks:
the records' offsets as an array, their values, and their header blocks as they are on the wire
(:func:`~aggregator.batch.decode_headers` reads one). :func:`batch_of` makes one Polled of a
whole poll, whichever parser made it; the validator and the fold take that batch
(aggregator/batch.py).

Parsing a version-2 batch (:func:`parse_records`). Records follow one another, each starting
with its length, so finding them is sequential; but a producer's records are nearly always
alike: same key and value sizes, same headers, and timestamp and offset deltas of the same
varint width. The parser decodes one record in Python as a *template*, then checks, for every
following record at once (numpy), that the bytes which fix the layout are the template's: the
length, key length, value length, header count and header lengths byte for byte, and the
continuation bits of every varint whose value may differ (attributes, timestamp delta, offset
delta). The records that pass have exactly the template's layout, so their offsets and values
are read at fixed positions; the first that does not starts the next template. A batch of one
producer is one or a few runs, whatever its size.

A batch whose CRC-32C fails, a malformed record and bytes left over after the batch's records
raise ``CorruptRecordError``, as with kafka-python's own parser, but for the whole batch (the
library first delivers the records before the bad one; either way the position stays before it
and nothing is skipped). Two checks are stricter than the library's: an offset delta wider than
its int32 varint and an offset outside 0 … 2⁶³ − 1 are refused too (the library hands them out).
One is lazier: header keys are decoded (invalid UTF-8 replaced) only when a rejected record's
headers are read, where the library refuses the batch and the partition stalls on it. Control
batches are skipped. Batches of the old message formats (magic 0 and 1) go through
kafka-python's parser, inner-message CRCs checked; a compressed batch is decompressed by it and
then parsed here. Only a consumer reading uncommitted data can use this (the aggregator's is;
the read_committed filtering of aborted transactions is not reimplemented).
This module is the only place that touches kafka-python's internals: ``Fetcher.PartitionRecords``,
a batch's buffer and (:func:`topic_id_seen`) the client's cluster metadata. :func:`install`
refuses a kafka-python outside the release series it was checked against
(:data:`CHECKED_SERIES`) or without those parts, and tests/aggregator/test_fetch.py compares
both parsers on batches a real broker served.
"""

from __future__ import annotations

import logging
import operator
import sys
from dataclasses import dataclass

import kafka
import numpy as np
from kafka.consumer.fetcher import Fetcher
from kafka.errors import CorruptRecordError
from kafka.record.default_records import DefaultRecordBatch
from kafka.record.util import decode_varint

from aggregator.batch import Polled
from ipdp.errors import IpdpError

log = logging.getLogger(__name__)

__all__ = ["ColumnarRecords", "UnsupportedKafkaClient", "batch_of", "install", "parse_records",
           "topic_id_seen"]

#: kafka-python's isolation level value for read_uncommitted (kafka.protocol's IsolationLevel).
READ_UNCOMMITTED = 0
_OFFSET = operator.attrgetter("offset")
_VALUE = operator.attrgetter("value")
_HEADERS = operator.attrgetter("headers")

#: The kafka-python release series whose internals this module was checked against.
CHECKED_SERIES = "3.0."
#: An offset delta is an int32 varint: at most 5 bytes (kafka-python would read up to 10).
MAX_OFFSET_DELTA_WIDTH = 5


class UnsupportedKafkaClient(IpdpError):
    """The installed kafka-python does not have the internals the columnar fetch replaces."""

    exit_code = 2


@dataclass(frozen=True)
class _Layout:
    """One record's layout, relative to its first byte.

    ``rel``/``mask``/``expect``: the bytes that fix the layout and what (masked) they must hold.
    """

    size: int
    rel: np.ndarray
    mask: np.ndarray
    expect: np.ndarray
    offset_rel: int
    offset_width: int
    value_rel: int
    value_len: int
    headers_rel: int
    headers_len: int


def _template(buf: bytes, pos: int) -> _Layout:
    """Decode the record at ``pos`` (kafka-python's order and rules) into its layout."""
    # (start, end, exact): bytes every record of the layout repeats exactly, or (not exact) a
    # varint whose value may differ but whose width may not (only the continuation bits count).
    spans: list[tuple[int, int, bool]] = []
    length, p = decode_varint(buf, pos)
    spans.append((pos, p, True))
    body = p
    if length <= 0:
        raise ValueError(f"record length {length}")
    _, q = decode_varint(buf, p)  # attributes: kafka-python reads them as a varint
    spans.append((p, q, False))
    p = q
    _, q = decode_varint(buf, p)  # timestamp delta
    spans.append((p, q, False))
    p = q
    _, q = decode_varint(buf, p)  # offset delta
    spans.append((p, q, False))
    offset_rel, offset_width = p - pos, q - p
    if offset_width > MAX_OFFSET_DELTA_WIDTH:
        raise CorruptRecordError(f"offset delta of {offset_width} varint bytes")
    p = q
    key_len, q = decode_varint(buf, p)
    spans.append((p, q, True))
    p = q + max(key_len, 0)
    value_len, q = decode_varint(buf, p)
    spans.append((p, q, True))
    value_rel = q - pos
    p = q + max(value_len, 0)
    headers_rel = p - pos
    count, q = decode_varint(buf, p)
    spans.append((p, q, True))
    if count < 0:
        raise CorruptRecordError(f"Found invalid number of record headers {count}")
    p = q
    for _ in range(count):
        key_len, q = decode_varint(buf, p)
        spans.append((p, q, True))
        if key_len < 0:
            raise CorruptRecordError(f"Invalid negative header key size {key_len}")
        p = q + key_len
        value_len_h, q = decode_varint(buf, p)
        spans.append((p, q, True))
        p = q + max(value_len_h, 0)
    if p - body != length:
        raise CorruptRecordError(f"Invalid record size: expected to read {length} bytes in "
                                 f"record payload, but instead read {p - body}")
    if p > len(buf):
        raise ValueError("record runs past the batch")
    # Per byte: its position, whether it repeats exactly, and (a varint's width) whether its
    # continuation bit is set: on every byte of a varint but the last.
    at = [(i, exact, i < end - 1) for start, end, exact in spans for i in range(start, end)]
    return _Layout(p - pos, np.array([i - pos for i, _, _ in at], np.int64),
                   np.array([0xFF if exact else 0x80 for _, exact, _ in at], np.uint8),
                   np.array([buf[i] if exact else 0x80 * more for i, exact, more in at],
                            np.uint8),
                   offset_rel, offset_width, value_rel, value_len, headers_rel,
                   p - pos - headers_rel)


def _zigzag_at(a: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The zigzag varints of ``width`` bytes starting at positions ``at`` of ``a``."""
    v = np.zeros(len(at), np.int64)
    for i in range(width):
        v |= (a[at + i].astype(np.int64) & 0x7F) << (7 * i)
    return (v >> 1) ^ -(v & 1)


def parse_records(buf: bytes, pos: int, count: int, base_offset: int
                  ) -> tuple[np.ndarray, list, list]:
    """The ``count`` records of a version-2 batch whose records start at ``buf[pos]``:
    (offsets, values, header blocks). Raises CorruptRecordError like kafka-python's parser."""
    a = np.frombuffer(buf, np.uint8)
    end = len(buf)
    offsets: list[np.ndarray] = []
    values: list = []
    headers: list = []
    done = 0
    try:
        while done < count:
            t = _template(buf, pos)
            m = min(count - done, (end - pos) // t.size)
            starts = pos + t.size * np.arange(m, dtype=np.int64)
            if m > 1:
                ok = ((a[starts[:, None] + t.rel] & t.mask) == t.expect).all(axis=1)
                if not ok.all():
                    starts = starts[:int(np.argmin(ok))]  # ok[0] holds: it is the template
            deltas = _zigzag_at(a, starts + t.offset_rel, t.offset_width)
            if base_offset + int(deltas.min()) < 0 or base_offset + int(deltas.max()) >= 1 << 63:
                raise CorruptRecordError("record offset outside 0 … 2^63 − 1")
            offsets.append(base_offset + deltas)
            if t.value_len >= 0:
                n = t.value_len
                values += [buf[s:s + n] for s in (starts + t.value_rel).tolist()]
            else:
                values += [None] * len(starts)
            n = t.headers_len
            headers += [buf[s:s + n] for s in (starts + t.headers_rel).tolist()]
            pos += t.size * len(starts)
            done += len(starts)
    except (ValueError, IndexError) as exc:
        raise CorruptRecordError(f"Found invalid record structure: {exc!r}") from exc
    if pos != end:
        raise CorruptRecordError(f"{end - pos} unconsumed bytes after all records consumed")
    return (np.concatenate(offsets) if offsets else np.zeros(0, np.int64)), values, headers


def batch_of(polled: dict) -> Polled:
    """A poll's records as one Polled in (partition, offset) order: the columnar fetch's chunks
    joined, or kafka-python's ``ConsumerRecord`` objects (``IPDP_AGGREGATOR_COLUMNAR_FETCH=false``)
    gathered once per partition. No Python loop per record."""
    chunks = []
    for tp, recs in sorted(polled.items()):  # one topic: by partition
        if type(recs[0]) is Polled:
            chunks += recs
        else:
            chunks.append(Polled(np.full(len(recs), tp.partition, np.int64),
                                 np.fromiter(map(_OFFSET, recs), np.int64, len(recs)),
                                 list(map(_VALUE, recs)), headers=list(map(_HEADERS, recs))))
    return Polled.join(chunks)


class _Taken(list):
    """What :meth:`ColumnarRecords.take` hands kafka-python: a list holding one Polled chunk
    (the poll's list for the partition is extended with it), whose length is the chunk's record
    count, since kafka-python counts a poll's records by that length."""

    def __len__(self) -> int:
        return len(self[0])


@dataclass
class _Rows:
    """One batch's records from ``fetch_offset`` on, and the offset after the batch."""

    offsets: np.ndarray
    values: list
    headers: list
    next_offset: int


class ColumnarRecords(Fetcher.PartitionRecords):
    """kafka-python's PartitionRecords with the per-record parser replaced (module docstring).

    ``take(n)`` returns up to n records as one :class:`Polled` chunk and moves
    ``next_fetch_offset`` exactly as the library's iterator does.
    """

    def __init__(self, fetch_offset, tp, records, **kwargs) -> None:
        super().__init__(fetch_offset, tp, records, **kwargs)
        self.record_iterator = self._batches(records)  # the library's generator is never run
        self._rows: _Rows | None = None
        self._at = 0

    def _batches(self, records):
        """One _Rows per record batch, parsed when ``take`` reaches it."""
        while True:
            batch = records.next_batch()
            if batch is None:
                return
            if self.check_crcs and not batch.validate_crc():
                raise CorruptRecordError(
                    f"Record batch for partition {self.topic_partition} at offset "
                    f"{batch.base_offset} failed crc check")
            if batch.magic < 2:
                yield self._legacy(batch)
                continue
            self.leader_epoch = batch.leader_epoch
            if batch.is_control_batch:
                yield _Rows(np.zeros(0, np.int64), [], [], batch.next_offset)
                continue
            iter(batch)  # decompresses a compressed batch, as the library's parser would
            offsets, values, headers = parse_records(
                bytes(batch._buffer), batch._pos, batch.records_count, batch.base_offset)
            self.records_read += len(values)
            self.bytes_read += batch.size_in_bytes
            if len(offsets) and offsets[0] < self.fetch_offset:  # a batch begun before the fetch
                keep = int(np.searchsorted(offsets, self.fetch_offset))
                offsets, values, headers = offsets[keep:], values[keep:], headers[keep:]
            yield _Rows(offsets, values, headers, batch.next_offset)

    def _legacy(self, batch) -> _Rows:
        """A magic 0/1 batch, through kafka-python's own parser."""
        rows = []
        for r in batch:
            if self.check_crcs and not r.validate_crc():
                raise CorruptRecordError(f"Record for partition {self.topic_partition} at offset "
                                         f"{r.offset} failed crc check")
            if r.offset >= self.fetch_offset:
                rows.append((r.offset, r.value, r.headers))
        self.records_read += len(rows)
        self.bytes_read += batch.size_in_bytes
        last = rows[-1][0] + 1 if rows else self.next_fetch_offset
        return _Rows(np.array([r[0] for r in rows], np.int64), [r[1] for r in rows],
                     [r[2] for r in rows], last)

    def take(self, n=None):
        """Up to ``n`` records as one Polled chunk (in a list, as kafka-python expects)."""
        self._maybe_raise_next_inline_exception()
        left = sys.maxsize if n is None else n
        offsets: list[np.ndarray] = []
        values: list = []
        headers: list = []
        try:
            while left > 0 and self.record_iterator is not None:
                if self._rows is None:
                    self._rows, self._at = next(self.record_iterator, None), 0
                    if self._rows is None:
                        self.drain()
                        break
                rows, at = self._rows, self._at
                k = min(left, len(rows.values) - at)
                if k:
                    offsets.append(rows.offsets[at:at + k])
                    values += rows.values[at:at + k]
                    headers += rows.headers[at:at + k]
                    self._at, left = at + k, left - k
                    self.next_fetch_offset = int(rows.offsets[at + k - 1]) + 1
                if self._at == len(rows.values):
                    self.next_fetch_offset = max(self.next_fetch_offset, rows.next_offset)
                    self._rows = None
        except Exception as exc:
            if not values:
                raise
            self._next_inline_exception = exc  # raised by the next take, as the library does
        if not values:
            return []
        return _Taken((Polled(np.full(len(values), self.topic_partition.partition, np.int64),
                              np.concatenate(offsets), values, headers=headers),))


def install(consumer) -> None:
    """Make ``consumer`` (a KafkaConsumer reading uncommitted data) parse batches as arrays;
    its polls then return Polled chunks per partition. Raises UnsupportedKafkaClient
    when the installed kafka-python lacks what this replaces."""
    fetcher = getattr(consumer, "_fetcher", None)
    parts = getattr(Fetcher, "PartitionRecords", None)
    needed = ("take", "drain", "_maybe_raise_next_inline_exception")
    batch_slots = getattr(DefaultRecordBatch, "__slots__", ())
    if not kafka.__version__.startswith(CHECKED_SERIES):
        raise UnsupportedKafkaClient(
            f"the columnar fetch was checked against kafka-python {CHECKED_SERIES}x, not "
            f"{kafka.__version__}; set IPDP_AGGREGATOR_COLUMNAR_FETCH=false to use its own parser")
    if fetcher is None or parts is None or not all(hasattr(parts, x) for x in needed) \
            or not {"_buffer", "_pos"} <= set(batch_slots):
        raise UnsupportedKafkaClient(
            "this kafka-python lacks the parts the columnar fetch replaces "
            "(Fetcher.PartitionRecords, a batch's buffer); set "
            "IPDP_AGGREGATOR_COLUMNAR_FETCH=false to use its own parser")
    if getattr(fetcher, "_isolation_level", READ_UNCOMMITTED) != READ_UNCOMMITTED:
        raise UnsupportedKafkaClient("the columnar fetch reads uncommitted data only; set "
                                     "IPDP_AGGREGATOR_COLUMNAR_FETCH=false for read_committed")
    fetcher.PartitionRecords = ColumnarRecords


def topic_id_seen(consumer, topic: str) -> str | None:
    """The id of ``topic`` in ``consumer``'s latest metadata (no request; None before the
    client has one). kafka-python exposes no public accessor for a topic's id."""
    seen = consumer._client.cluster.topic_id(topic)
    return None if seen is None else str(seen)
