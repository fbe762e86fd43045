"""The dead-letter topic's messages: containers of refused records, each with its reason.

The aggregator writes what it refuses as the gateway writes records: many to a Kafka message.
A dead-letter container (version 1, docs/wire-format.md "Dead letters") holds a table of causes
(reason, detail), then one fixed 24-byte entry per refused record (its source partition, offset
and container index, its cause, the length of its bytes), then the records' bytes back to back.
Its Kafka headers are ``dead-letters`` (the container version) and ``topic`` (the records
topic). :func:`encode_dead_letters` makes containers from arrays, with no Python step per
record; :func:`read_dead_letters` reads any message of the topic, including the single-record
form that aggregators wrote before containers (headers ``reason``, ``detail``, ``source``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DEAD_LETTERS_HEADER", "DEAD_LETTERS_VERSION", "DeadLetter", "dead_letter_headers",
           "encode_dead_letters", "read_dead_letters"]

#: Kafka header whose value (ASCII digits) is the container version of a dead-letter message.
DEAD_LETTERS_HEADER = "dead-letters"
DEAD_LETTERS_VERSION = 1
#: Kafka header naming the records topic the refused records were read from.
TOPIC_HEADER = "topic"
#: One refused record's entry: source partition, offset, index inside its container message
#: (-1: the message is the record), cause (a position in the causes table), bytes that follow.
ENTRY = np.dtype([("partition", "<u4"), ("offset", "<i8"), ("index", "<i4"),
                  ("cause", "<u4"), ("length", "<u4")])
_HEAD = 12  # version, 3 reserved bytes, u32 causes, u32 entries


@dataclass(frozen=True)
class DeadLetter:
    """One refused record as read back: where it came from, why, and its bytes (empty when
    they were over the aggregator's size limit)."""

    topic: str
    partition: int
    offset: int
    index: int | None
    reason: str
    detail: str
    value: bytes

    @property
    def source(self) -> str:
        """``partition:offset`` or, inside a container, ``partition:offset#index``."""
        where = f"{self.partition}:{self.offset}"
        return where if self.index is None else f"{where}#{self.index}"


def dead_letter_headers(topic: str) -> list[tuple[str, bytes]]:
    """The Kafka headers of a dead-letter container of records read from ``topic``."""
    return [(DEAD_LETTERS_HEADER, str(DEAD_LETTERS_VERSION).encode()),
            (TOPIC_HEADER, topic.encode())]


def _bytes_of(values: Sequence, max_value_bytes: int) -> tuple[list, np.ndarray]:
    """The values as buffers (anything not bytes-like, or longer than ``max_value_bytes``,
    becomes empty) and their lengths."""
    try:
        lengths = np.fromiter(map(len, values), np.int64, len(values))
        buffers = list(values)
    except TypeError:  # a tombstone (None) or an odd type among them
        buffers = [v if isinstance(v, bytes | bytearray | memoryview) else b"" for v in values]
        lengths = np.fromiter(map(len, buffers), np.int64, len(buffers))
    too_long = np.flatnonzero(lengths > max_value_bytes)
    for i in too_long.tolist():
        buffers[i] = b""
    lengths[too_long] = 0
    return buffers, lengths


def encode_dead_letters(partition: np.ndarray, offset: np.ndarray, index: np.ndarray,
                        cause: np.ndarray, causes: Sequence[tuple[str, str]], values: Sequence,
                        *, max_bytes: int) -> list[tuple[bytes, bytes]]:
    """(Kafka key, value) of the containers holding the refused records given as arrays: per
    record its source ``partition``, ``offset``, ``index`` (-1: not in a container), ``cause``
    (a position in ``causes``, the (reason, detail) pairs) and its bytes. A container's entries
    and bytes stay within ``max_bytes`` (a record's bytes longer than that are left out)."""
    buffers, lengths = _bytes_of(values, max_bytes)
    table = b"".join(
        len(r.encode()).to_bytes(1, "little") + r.encode()
        + len(d.encode()[:0xFFFF]).to_bytes(2, "little") + d.encode()[:0xFFFF]
        for r, d in causes)
    entries = np.empty(len(lengths), ENTRY)
    entries["partition"], entries["offset"], entries["index"] = partition, offset, index
    entries["cause"], entries["length"] = cause, lengths
    ends = np.cumsum(lengths + ENTRY.itemsize)
    out = []
    start = 0
    while start < len(lengths):
        before = int(ends[start - 1]) if start else 0
        end = max(int(np.searchsorted(ends, before + max_bytes, "right")), start + 1)
        head = bytes((DEAD_LETTERS_VERSION, 0, 0, 0)) + len(causes).to_bytes(4, "little") \
            + (end - start).to_bytes(4, "little")
        e = entries[start]
        key = f"{e['partition']}:{e['offset']}" + (f"#{e['index']}" if e["index"] >= 0 else "")
        out.append((key.encode(), b"".join([head, table, entries[start:end].tobytes(),
                                            *buffers[start:end]])))
        start = end
    return out


def read_dead_letters(value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
                      ) -> list[DeadLetter]:
    """The refused records of one dead-letter message (its value and Kafka headers), whether a
    container or the single-record form."""
    named = {k: v for k, v in headers or ()}
    if DEAD_LETTERS_HEADER not in named:  # one record per message, reason in its headers
        topic, partition, offset = named["source"].decode().rsplit(":", 2)
        offset, _, index = offset.partition("#")
        return [DeadLetter(topic, int(partition), int(offset), int(index) if index else None,
                           named["reason"].decode(), named["detail"].decode(), value or b"")]
    version = int(named[DEAD_LETTERS_HEADER])
    if version != DEAD_LETTERS_VERSION or value[0] != DEAD_LETTERS_VERSION:
        raise ValueError(f"dead-letter container version {version}, supported: "
                         f"{DEAD_LETTERS_VERSION}")
    topic = named[TOPIC_HEADER].decode()
    c, k = int.from_bytes(value[4:8], "little"), int.from_bytes(value[8:12], "little")
    causes, p = [], _HEAD
    for _ in range(c):
        n = value[p]
        reason = value[p + 1:p + 1 + n].decode()
        p += 1 + n
        m = int.from_bytes(value[p:p + 2], "little")
        causes.append((reason, value[p + 2:p + 2 + m].decode("utf-8", "replace")))
        p += 2 + m
    entries = np.frombuffer(value, ENTRY, k, p)
    starts = p + k * ENTRY.itemsize + np.cumsum(entries["length"], dtype=np.int64) \
        - entries["length"]
    if k and int(starts[-1]) + int(entries["length"][-1]) != len(value):
        raise ValueError("dead-letter container: the entries' lengths do not add up")
    return [DeadLetter(topic, part, off, None if i < 0 else i, *causes[cause],
                       value[s:s + n])
            for part, off, i, cause, n, s in zip(
                entries["partition"].tolist(), entries["offset"].tolist(),
                entries["index"].tolist(), entries["cause"].tolist(),
                entries["length"].tolist(), starts.tolist(), strict=True)]
