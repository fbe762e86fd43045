"""The JSON form of a records POST, wire-encoded so it takes the binary form's checks.

``{"records": [{"record_id": "<32 hex>", "created_ms": int, "q": [...], "p": [...]}]}``: parsed
strictly by pydantic, then encoded as version-1 records back to back (ipdp.wire), so the checks
of gateway.checks and the group commit see the bytes a device would have sent.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.refusals import Refusal
from ipdp.study import Study
from ipdp.wire import ID_SIZE, RejectReason, encode_batch

__all__ = ["JsonRecord", "JsonRecords", "encode_json"]

_I64 = (-(2**63), 2**63 - 1)


class JsonRecord(BaseModel):
    """One record in the JSON form of a POST (the gateway wire-encodes it). Strict types: a
    number in a string, or a boolean, is refused (a JSON integer is a number for q and p)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    record_id: str = Field(pattern=r"^[0-9a-fA-F]{32}$")
    created_ms: int = Field(ge=_I64[0], le=_I64[1])
    q: list[float] = Field(min_length=1)
    p: list[float] = Field(min_length=1)


class JsonRecords(BaseModel):
    """The JSON body of a POST: ``{"records": [...]}``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    records: list[JsonRecord] = Field(min_length=1)


def encode_json(body: bytes, study: Study) -> bytes:
    """Wire-encode the records of a JSON body, back to back; raises Refusal (400) if one is
    unusable."""
    try:
        parsed = JsonRecords.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise Refusal(RejectReason.UNDECODABLE, f"{where}: {first['msg']}") from None
    recs = parsed.records
    k = len(recs)
    for i, r in enumerate(recs):
        if len(r.q) != study.d or len(r.p) != study.d:
            raise Refusal(RejectReason.WRONG_DIMENSION, f"record {i} has len(q)={len(r.q)}, "
                          f"len(p)={len(r.p)}, study {study.study_id!r} has d={study.d}",
                          records=k)
    q = np.array([r.q for r in recs], dtype=np.float64)
    p = np.array([r.p for r in recs], dtype=np.float64)
    bad = np.flatnonzero(~(np.isfinite(q).all(axis=1) & np.isfinite(p).all(axis=1)))
    if bad.size:
        raise Refusal(RejectReason.NON_FINITE, f"record {int(bad[0])}: q̃ or p̃ holds NaN or Inf",
                      records=k)
    ids = np.frombuffer(b"".join(bytes.fromhex(r.record_id) for r in recs),
                        dtype=np.uint8).reshape(k, ID_SIZE)
    ms = np.array([r.created_ms for r in recs], dtype=np.int64)
    return b"".join(encode_batch(study.hash, ids, ms, q, p))
