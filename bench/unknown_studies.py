"""Fold rate of records whose study hash no study has, next to valid records: one made-up hash
must not cost a Redis round trip per record. Prints a markdown table; nothing is asserted.

    python -m bench.unknown_studies [--records N]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from aggregator.batch import Polled
from aggregator.fold import Folder
from ipdp import state
from ipdp.embedded import EmbeddedRedis
from ipdp.redis_io import redis_client
from ipdp.study import Study
from ipdp.wire import encode_batch
from producer.contributor import new_record_ids, now_ms

BATCH = 5000


def _values(study_hashes: list[bytes], d: int, seed: int) -> list[bytes]:
    """One small valid-looking record per hash (the hash is all that differs)."""
    rng = np.random.default_rng(seed)
    k = len(study_hashes)
    q, p = rng.normal(size=(k, d)) * 0.01, rng.normal(size=(k, d)) * 0.01
    ids, created = new_record_ids(k), np.full(k, now_ms(), np.int64)
    if len(set(study_hashes)) == 1:
        return encode_batch(study_hashes[0], ids, created, q, p)
    return [encode_batch(h, ids[i:i + 1], created[i:i + 1], q[i:i + 1], p[i:i + 1])[0]
            for i, h in enumerate(study_hashes)]


def _rate(r, values: list[bytes], group: str) -> float:
    folder = Folder(r, group=group, topic="t", replay_window_s=86_400, max_future_skew_s=300,
                    max_message_bytes=1 << 20)
    t0 = time.perf_counter()
    for s in range(0, len(values), BATCH):
        chunk = values[s:s + BATCH]
        folder.fold(Polled(np.zeros(len(chunk), np.int64), np.arange(s, s + len(chunk)), chunk))
    return len(values) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=50_000, help="Records per row (50000).")
    k = ap.parse_args().records
    study = Study(study_id="valid", d=14, n=10**9, epsilon=1.0, delta=0.01)
    cases = {
        "valid records of one study": [study.hash] * k,
        "one unknown hash, repeated": [os.urandom(16)] * k,
        "a new random hash per record": [os.urandom(16) for _ in range(k)],
    }
    print("| records | folded or rejected per second |\n|---|---|")
    with EmbeddedRedis() as srv:
        r = redis_client(srv.settings())
        state.register_study(r, study)
        study.norm_bounds  # noqa: B018 - its one-time imports are no part of any row
        for i, (what, hashes) in enumerate(cases.items()):
            print(f"| {what} | {_rate(r, _values(hashes, study.d, i), f'g{i}'):,.0f} |")


if __name__ == "__main__":
    main()
