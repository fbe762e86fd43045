"""Which study a record's hash names, and whether a ``study`` header names a registered one.

The fold asks once per batch, for the distinct hashes of its records (:meth:`StudyLookup.resolve`)
and, for records whose hash names no study, for the distinct ``study`` headers they carry
(:meth:`StudyLookup.registered`). A study never changes, so a found one is kept until the fold
finds it deleted (:meth:`StudyLookup.forget`, ipdp.state.delete_study); a hash
or an id that names nothing is remembered as such for ``unknown_ttl_s``, so records with made-up
hashes cost no Redis lookup each; a study whose signature does not verify, or whose stored
definition cannot be read, is refused and looked up again after REFUSAL_RETRY_S, so a study
re-signed by its owner is taken up without a restart.
"""

from __future__ import annotations

import logging
import time

import redis

from ipdp import metrics, state
from ipdp.errors import MalformedValue, SignatureError
from ipdp.signing import TrustedKeys
from ipdp.study import Study
from ipdp.wire import MalformedRecord, RejectReason

log = logging.getLogger(__name__)

#: A study refused for its signature is looked up again after this many seconds.
REFUSAL_RETRY_S = 30.0
#: Most unknown study hashes (and ids) remembered at once.
UNKNOWN_CACHE_LIMIT = 100_000

Resolved = Study | MalformedRecord | None
"""What a study hash names: the study, a refusal (``untrusted_study``), or nothing."""


class StudyLookup:
    """The studies of one aggregator, looked up in Redis and kept."""

    def __init__(self, r: redis.Redis, *, trusted: TrustedKeys | None,
                 unknown_ttl_s: float) -> None:
        self.r = r
        self.trusted = trusted
        self.unknown_ttl_s = unknown_ttl_s
        self._studies: dict[bytes, Study] = {}
        self._refused: dict[bytes, tuple[float, str]] = {}
        self._unknown_hashes: dict[bytes, float] = {}
        self._registered_ids: set[str] = set()
        self._unknown_ids: dict[str, float] = {}

    def resolve(self, hashes: list[bytes]) -> dict[bytes, Resolved]:
        """Each study hash's study, refusal or None; the hashes not known here are looked up in
        one HMGET."""
        now = time.monotonic()
        out: dict[bytes, Resolved] = {}
        ask = []
        for h in hashes:
            if (study := self._studies.get(h)) is not None:
                out[h] = study
            elif (refused := self._refused.get(h)) and now - refused[0] < REFUSAL_RETRY_S:
                out[h] = MalformedRecord(RejectReason.UNTRUSTED_STUDY, refused[1])
            elif (since := self._unknown_hashes.get(h)) is not None \
                    and now - since < self.unknown_ttl_s:
                out[h] = None
            else:
                ask.append(h)
        if ask:
            for h, sid in zip(ask, self.r.hmget(state.STUDY_HASHES, ask), strict=True):
                out[h] = None if sid is None else self._load(h, sid.decode())
                if out[h] is None:
                    _remember(self._unknown_hashes, h, now, self.unknown_ttl_s)
        return out

    def _load(self, key: bytes, study_id: str) -> Resolved:
        try:
            found = state.load_study(self.r, study_id, self.trusted)
        except (SignatureError, MalformedValue) as exc:
            metrics.STUDIES_REFUSED.labels("aggregator").inc()
            log.error("refusing records of study hash %s: %s", key.hex(), exc)
            self._refused[key] = (time.monotonic(), str(exc))
            return MalformedRecord(RejectReason.UNTRUSTED_STUDY, str(exc))
        if found is None:
            return None
        self._refused.pop(key, None)
        study = self._studies[key] = found[0]
        study.round_limit  # noqa: B018 - the budget's accounting, once, outside any fold
        return study

    def forget(self, study: Study) -> None:
        """Drop a study the fold found deleted: its hash and id are looked up again."""
        self._studies.pop(study.hash, None)
        self._registered_ids.discard(study.study_id)

    def registered(self, names: set[str]) -> dict[str, bool]:
        """Whether each study id is registered (a registered one stays so; an unregistered one
        is remembered as such for ``unknown_ttl_s``)."""
        now = time.monotonic()
        out = {x: True for x in names if x in self._registered_ids}
        ask = sorted(x for x in names if x not in out and not (
            (since := self._unknown_ids.get(x)) is not None and now - since < self.unknown_ttl_s))
        out.update((x, False) for x in names if x not in out and x not in ask)
        if ask:
            with self.r.pipeline(transaction=False) as pipe:
                for x in ask:
                    pipe.exists(state.StudyKeys(x).study)
                for x, exists in zip(ask, pipe.execute(), strict=True):
                    out[x] = bool(exists)
                    if exists:
                        self._registered_ids.add(x)
                    else:
                        _remember(self._unknown_ids, x, now, self.unknown_ttl_s)
        return out


def _remember(cache: dict, key, now: float, ttl_s: float) -> None:
    """Note ``key`` as unknown at ``now``; past UNKNOWN_CACHE_LIMIT entries the expired ones
    go first, then all (a flood of made-up hashes must not grow memory without bound)."""
    if len(cache) >= UNKNOWN_CACHE_LIMIT:
        for k in [k for k, t in cache.items() if now - t >= ttl_s]:
            del cache[k]
        if len(cache) >= UNKNOWN_CACHE_LIMIT:
            cache.clear()
    cache[key] = now
