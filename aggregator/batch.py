"""The aggregator's batch types: what a poll becomes, and what the checks refuse of it.

A poll is one :class:`Polled`: per row a partition, an offset, a container index, a value and
the Kafka header block, as arrays (aggregator/fetch.py makes it; the validator splits
containers into rows; the fold keeps or drops rows with index arrays). What is refused is one
:class:`Refused`: the refused rows as a Polled, and per row its *cause*, the position of a
(reason, detail) pair in a short list. Neither holds a Python object per record: a refusal costs
what a fold costs (docs/security.md, "Against a flood"). :class:`Rejection` is one refused
record as an object, made only when someone asks for them one by one (tests, logs).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from kafka.record.util import decode_varint

from ipdp.wire import RejectReason, header_study, study_headers

__all__ = ["NOT_IN_CONTAINER", "REASONS", "Message", "Polled", "Refused", "Rejection",
           "decode_headers"]

NOT_IN_CONTAINER = -1
"""The ``index`` of a record that is a Kafka message of its own."""

REASONS: tuple[RejectReason, ...] = tuple(RejectReason)
"""A reason's code in this process (its position here); never written anywhere."""
_CODE = {reason: code for code, reason in enumerate(REASONS)}


@dataclass(frozen=True)
class Message:
    """The parts of a Kafka record the fold needs; ``study_id`` is the device's ``study`` header."""

    partition: int
    offset: int
    value: bytes | None
    study_id: str | None = None


def decode_headers(block) -> list[tuple[str, bytes | None]]:
    """A record's header block (count, then key/value pairs) as kafka-python's header list;
    a list is returned as it is (records parsed by kafka-python)."""
    if not isinstance(block, bytes | bytearray | memoryview):
        return block or []
    count, p = decode_varint(block, 0)
    out = []
    for _ in range(count):
        key_len, p = decode_varint(block, p)
        key = bytes(block[p:p + key_len]).decode("utf-8", errors="replace")
        p += key_len
        value_len, p = decode_varint(block, p)
        out.append((key, None if value_len < 0 else bytes(block[p:p + value_len])))
        p += max(value_len, 0)
    return out


@dataclass
class Polled:
    """Records of a poll as arrays, the one shape from the fetch to the fold: ``partition``,
    ``offset`` and container ``index`` per row (NOT_IN_CONTAINER for a plain message; the
    validator gives a container's records 0..k-1), ``values`` and the Kafka ``headers`` (None:
    none gathered; per row the wire's header block or, from kafka-python's own parser, a header
    list) in the same order. Headers are read only for rejected rows."""

    partition: np.ndarray
    offset: np.ndarray
    values: list
    index: np.ndarray | None = None
    headers: list | None = None

    def __post_init__(self) -> None:
        if self.index is None:
            self.index = np.full(len(self.values), NOT_IN_CONTAINER, np.int64)

    @classmethod
    def of(cls, messages: Sequence[Message]) -> Polled:
        """From Message objects in any order (tests, benchmarks), sorted by (partition, offset)."""
        polled = cls(np.fromiter((m.partition for m in messages), np.int64, len(messages)),
                     np.fromiter((m.offset for m in messages), np.int64, len(messages)),
                     [m.value for m in messages],
                     headers=[study_headers(m.study_id) if m.study_id else None
                              for m in messages])
        return polled.take(np.lexsort((polled.offset, polled.partition)))

    @classmethod
    def join(cls, chunks: Sequence[Polled]) -> Polled:
        """The rows of ``chunks``, one after the other."""
        if len(chunks) == 1:
            return chunks[0]
        if not chunks:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), [])
        headers = None
        if any(c.headers is not None for c in chunks):
            headers = [h for c in chunks
                       for h in (c.headers if c.headers is not None else [None] * len(c))]
        return cls(np.concatenate([c.partition for c in chunks]),
                   np.concatenate([c.offset for c in chunks]),
                   [v for c in chunks for v in c.values],
                   np.concatenate([c.index for c in chunks]), headers)

    def study_headers(self, rows: Sequence[int]) -> list[str | None]:
        """The ``study`` header of each of ``rows``; a container's records share one header
        block, which is read once."""
        if self.headers is None:
            return [None] * len(rows)
        read: dict[int, str | None] = {}
        out = []
        for i in rows:
            block = self.headers[i]
            if id(block) not in read:
                read[id(block)] = header_study(decode_headers(block))
            out.append(read[id(block)])
        return out

    def __len__(self) -> int:
        """Return the number of rows."""
        return len(self.values)

    def take(self, rows: np.ndarray) -> Polled:
        """The rows at positions ``rows``, in that order."""
        picked = rows.tolist()
        values = self.values
        return Polled(self.partition[rows], self.offset[rows], [values[i] for i in picked],
                      self.index[rows],
                      None if self.headers is None else [self.headers[i] for i in picked])


@dataclass(frozen=True)
class Rejection:
    """A record that will not be folded, and why.

    ``message.value`` is the record's own bytes; ``index`` is its position inside a container
    message (None when the message is the record)."""

    message: Message
    reason: RejectReason
    detail: str
    index: int | None = None

    @property
    def source(self) -> str:
        """``partition:offset`` or, inside a container, ``partition:offset#index``."""
        where = f"{self.message.partition}:{self.message.offset}"
        return where if self.index is None else f"{where}#{self.index}"


@dataclass
class Refused:
    """Records that will not be folded, as arrays: the refused ``records`` (a Polled), per row
    its ``cause`` (a position in ``causes``, the distinct (reason, detail) pairs) and ``row``,
    its position in the Polled it was refused from (comparable only within one such Polled)."""

    records: Polled
    cause: np.ndarray
    causes: list[tuple[RejectReason, str]]
    row: np.ndarray

    @classmethod
    def none(cls) -> Refused:
        """No refusal."""
        empty = np.zeros(0, np.int64)
        return cls(Polled(empty, empty, []), empty, [], empty)

    @classmethod
    def of(cls, polled: Polled, rows: np.ndarray, reason: RejectReason, detail: str) -> Refused:
        """Rows ``rows`` of ``polled``, all for one reason and detail."""
        rows = np.asarray(rows, np.int64)
        return cls(polled.take(rows), np.zeros(len(rows), np.int64), [(reason, detail)], rows)

    @classmethod
    def of_each(cls, polled: Polled, refusals: Sequence[tuple[int, RejectReason, str]]
                ) -> Refused:
        """From (row of ``polled``, reason, detail) triples (the decoder's per-row verdicts)."""
        causes: dict[tuple[RejectReason, str], int] = {}
        cause = np.fromiter((causes.setdefault((reason, detail), len(causes))
                             for _, reason, detail in refusals), np.int64, len(refusals))
        rows = np.fromiter((i for i, _, _ in refusals), np.int64, len(refusals))
        return cls(polled.take(rows), cause, list(causes), rows)

    @classmethod
    def join(cls, parts: Sequence[Refused]) -> Refused:
        """Every refusal of ``parts``, in that order, their causes merged."""
        parts = [x for x in parts if len(x)]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return cls.none()
        causes: dict[tuple[RejectReason, str], int] = {}
        remapped = []
        for x in parts:
            to = np.array([causes.setdefault(c, len(causes)) for c in x.causes], np.int64)
            remapped.append(to[x.cause])
        return cls(Polled.join([x.records for x in parts]), np.concatenate(remapped),
                   list(causes), np.concatenate([x.row for x in parts]))

    def __len__(self) -> int:
        """Return the number of refused records."""
        return len(self.cause)

    def take(self, rows: np.ndarray) -> Refused:
        """The refusals at positions (or where the mask) ``rows``."""
        rows = np.flatnonzero(rows) if rows.dtype == bool else rows
        return Refused(self.records.take(rows), self.cause[rows], self.causes, self.row[rows])

    def in_order(self) -> Refused:
        """The refusals in (partition, offset, container index) order."""
        r = self.records
        return self.take(np.lexsort((r.index, r.offset, r.partition)))

    def reason_codes(self) -> np.ndarray:
        """Per refusal, its reason's position in :data:`REASONS`."""
        per_cause = np.array([_CODE[reason] for reason, _ in self.causes], np.int64)
        return per_cause[self.cause] if len(self) else np.zeros(0, np.int64)

    def counts(self) -> dict[RejectReason, int]:
        """How many refusals each reason has."""
        codes, k = np.unique(self.reason_codes(), return_counts=True)
        return {REASONS[c]: n for c, n in zip(codes.tolist(), k.tolist(), strict=True)}

    def rejections(self) -> list[Rejection]:
        """The refusals one by one, as objects."""
        r = self.records
        studies = r.study_headers(range(len(r)))
        return [Rejection(Message(p, o, v, s), *self.causes[c],
                          None if i == NOT_IN_CONTAINER else i)
                for p, o, v, s, c, i in zip(r.partition.tolist(), r.offset.tolist(), r.values,
                                             studies, self.cause.tolist(), r.index.tolist(),
                                             strict=True)]

    def __iter__(self) -> Iterator[Rejection]:
        """The refusals as objects (:meth:`rejections`)."""
        return iter(self.rejections())
