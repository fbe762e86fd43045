"""Version-3 records as a two-server device builds them (docs/wire-format.md, "Two-server
records"), for the helper's tests: header (version 3) ‖ leader share ‖ sealed helper share ‖
u32 proof length."""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass

import numpy as np

from ipdp.fixed_point import FixedPoint, encode, fraction_bits_for, split
from ipdp.helper_protocol import TWO_SERVER_VERSION
from ipdp.sealing import seal_share
from ipdp.study import Study


def fixed_point_of(study: Study, clamp_log2: int = 2) -> FixedPoint:
    return FixedPoint(d=study.d, n=study.n, clamp_log2=clamp_log2,
                      fraction_bits=fraction_bits_for(study.n, clamp_log2))


def header(study: Study, record_id: bytes, created_ms: int, version: int = TWO_SERVER_VERSION
           ) -> bytes:
    return (struct.pack("<B3xI", version, study.d) + study.hash + record_id
            + struct.pack("<q", created_ms))


@dataclass
class Batch:
    """k records with what the test needs to check the servers: their ids, encoded values and
    leader shares."""

    records: list[bytes]
    ids: list[bytes]
    values: np.ndarray
    leader: np.ndarray


def make_records(study: Study, helper_public, k: int, rng: np.random.Generator, *,
                 created_ms: int | None = None, proof: bytes = b"",
                 record_ids: list[bytes] | None = None) -> Batch:
    """k well-formed records of ``study`` whose helper share is sealed to ``helper_public``
    (with the ids ``record_ids``, random ones if None)."""
    fp = fixed_point_of(study)
    q = rng.normal(0, 0.3, (k, study.d))
    p = np.ldexp(np.rint(np.ldexp(rng.normal(0, 0.3, (k, study.d)), 10)), -10)
    values, _ = encode(q, p, fp)
    leader, helper = split(values, rng.bytes)
    now = time.time_ns() // 1_000_000 if created_ms is None else created_ms
    records, ids = [], []
    for i in range(k):
        record_id = os.urandom(16) if record_ids is None else record_ids[i]
        head = header(study, record_id, now)
        sealed = seal_share(helper_public, helper[i].astype("<u8").tobytes(), head)
        records.append(head + leader[i].astype("<u8").tobytes() + sealed
                       + struct.pack("<I", len(proof)) + proof)
        ids.append(record_id)
    return Batch(records, ids, values, leader)
